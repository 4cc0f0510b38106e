r"""
What the fast Llama forward (`medusa_heads/fast_llama.py`) gives, against the transformers modules it replaces,
side by side in one process: the same model loaded twice (both packed for oneDNN, as the runtime loads it), each
method decoding the same prompts with the two interleaved per prompt. The table gives tokens/s (median over
prompts), the ratio fast over modules (median of the per-prompt ratios) and how many outputs are identical.

    python benchmarks/fast_forward.py --prompts benchmarks/prompts.jsonl --limit 8 --dtype bfloat16 \
        --methods plain,medusa+ngram:hydra-cpu-6
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from medusa_heads import MedusaModel
from medusa_heads.apps.bench import read_bench_prompts
from medusa_heads.backbone import load_tokenizer
from medusa_heads.inference import generate_ids, make_drafter
from medusa_heads.inference.generate import encode_prompt, eos_token_ids


def decode(model: MedusaModel, ids: torch.Tensor, method: str, max_new_tokens: int, eos: list[int]
           ) -> tuple[float, list[int]]:
    """(tokens/s, tokens) of one greedy answer by `method` (`DRAFTER[:TREE]`)."""
    name, _, tree = method.partition(":")
    drafter = make_drafter(model, name, **({"tree": tree} if tree else {}))
    start = time.perf_counter()
    tokens = [t for chunk in generate_ids(model, ids, drafter, max_new_tokens=max_new_tokens, eos_token_ids=eos)
              for t in chunk]
    return len(tokens) / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--methods", default="plain,medusa+ngram:hydra-cpu-6")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", type=Path, help="write the table and the per-prompt figures as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {"fast": MedusaModel.from_pretrained(dtype=args.dtype),
              "modules": MedusaModel.from_pretrained(dtype=args.dtype, fast_forward=False)}
    tokenizer = load_tokenizer()
    eos = eos_token_ids(models["fast"], tokenizer)
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in read_bench_prompts(args.prompts, args.limit)]
    methods = args.methods.split(",")
    for model in models.values():  # warm-up: first calls allocate and pick kernels
        decode(model, prompts[0], methods[0], 8, eos)
    rates = {(m, k): [] for m in methods for k in models}
    same = {m: 0 for m in methods}
    for i, ids in enumerate(prompts):
        for method in methods:
            order = list(models) if i % 2 == 0 else list(models)[::-1]
            outputs = {}
            for kind in order:
                rate, outputs[kind] = decode(models[kind], ids, method, args.max_new_tokens, eos)
                rates[method, kind].append(rate)
            same[method] += outputs["fast"] == outputs["modules"]
    lines = [f"| method | modules, tokens/s | fast, tokens/s | fast / modules (median, min-max) | identical |",
             "|---|---|---|---|---|"]
    for method in methods:
        ratios = [f / m for f, m in zip(rates[method, "fast"], rates[method, "modules"])]
        lines.append(f"| {method} | {statistics.median(rates[method, 'modules']):.1f} | "
                     f"{statistics.median(rates[method, 'fast']):.1f} | {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) | {same[method]}/{len(prompts)} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fast_forward.md").write_text(table + "\n")
        (args.out / "fast_forward.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "threads": torch.get_num_threads(),
             "tokens_per_second": {f"{m}/{k}": v for (m, k), v in rates.items()}}, indent=1))


if __name__ == "__main__":
    main()
