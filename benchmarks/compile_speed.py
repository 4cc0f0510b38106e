r"""
What `torch.compile` gives on this device, for HF greedy and for tree decoding, side by side in one process.

Eager first, as the runtime loads a model (linear layers packed for oneDNN): HF `generate` greedy and each method
on the same prompts, interleaved. Then the model is loaded again without packing (inductor cannot lower the packed
layers), its backbone's decoder compiled (`compile_backbone`, inductor, dynamic sizes), a warm-up prompt pays for
the compilation, and the same runs are repeated. The table gives tokens/s (median over prompts) and the two ratios
the fast-path issue asks for: compiled over eager for HF greedy, and for each tree-decoding method.

    python benchmarks/compile_speed.py --prompts benchmarks/prompts.jsonl --limit 8 --dtype bfloat16 \
        --methods plain,medusa+ngram:cpu-16
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from medusa_heads import MedusaModel
from medusa_heads.apps.bench import read_bench_prompts
from medusa_heads.backbone import compile_backbone, load_tokenizer
from medusa_heads.inference import generate_ids, make_drafter
from medusa_heads.inference.generate import encode_prompt, eos_token_ids


def hf_rate(model, ids: torch.Tensor, max_new_tokens: int) -> float:
    start = time.perf_counter()
    out = model.backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)


def ours_rate(model, ids: torch.Tensor, method: str, max_new_tokens: int, eos: list[int]) -> float:
    name, _, tree = method.partition(":")
    drafter = make_drafter(model, name, **({"tree": tree} if tree else {}))
    start = time.perf_counter()
    tokens = sum(len(chunk) for chunk in generate_ids(model, ids, drafter, max_new_tokens=max_new_tokens,
                                                     eos_token_ids=eos))
    return tokens / (time.perf_counter() - start)


def run(model, prompts: list[torch.Tensor], methods: list[str], max_new_tokens: int, eos: list[int]) -> dict:
    rates = {m: [] for m in ["hf"] + methods}
    for ids in prompts:
        rates["hf"].append(hf_rate(model, ids, max_new_tokens))
        for method in methods:
            rates[method].append(ours_rate(model, ids, method, max_new_tokens, eos))
    return {m: statistics.median(r) for m, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--methods", default="plain,medusa+ngram:cpu-16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mode", help="torch.compile mode (default: inductor's default)")
    args = parser.parse_args()

    model = MedusaModel.from_pretrained(None, dtype=args.dtype)  # eager as the runtime runs: packed for oneDNN
    tokenizer = load_tokenizer(model.config.base_model_name_or_path, gguf_file=model.config.base_model_gguf_file)
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in read_bench_prompts(args.prompts, args.limit + 1)]
    warmup, prompts = prompts[0], prompts[1:]
    eos = eos_token_ids(model, tokenizer)
    methods = args.methods.split(",")
    eager = run(model, prompts, methods, args.max_new_tokens, eos)
    del model
    model = MedusaModel.from_pretrained(None, dtype=args.dtype, pack_weights=False)  # inductor cannot lower packing
    model.requires_grad_(False)
    compile_backbone(model.backbone, args.mode)
    start = time.perf_counter()
    run(model, [warmup], methods, args.max_new_tokens, eos)  # compiles every shape the runs meet
    compile_seconds = time.perf_counter() - start
    compiled = run(model, prompts, methods, args.max_new_tokens, eos)
    report = {"dtype": args.dtype, "threads": torch.get_num_threads(), "prompts": len(prompts),
              "compile_and_warmup_seconds": round(compile_seconds, 1),
              "tokens_per_s": {m: {"eager": round(eager[m], 1), "compiled": round(compiled[m], 1)} for m in eager}}
    print(json.dumps(report))
    print(f"\n{args.dtype}, {torch.get_num_threads()} threads, {len(prompts)} prompts, compile + warm-up "
          f"{compile_seconds:.0f} s\n\n| method | eager tokens/s | compiled tokens/s | compiled / eager | "
          "vs HF greedy, eager | vs HF greedy, compiled |\n|---|---|---|---|---|---|")
    for m in eager:
        print(f"| {m} | {eager[m]:.1f} | {compiled[m]:.1f} | {compiled[m] / eager[m]:.2f}x | "
              f"{eager[m] / eager['hf']:.2f}x | {compiled[m] / compiled['hf']:.2f}x |")


if __name__ == "__main__":
    main()
