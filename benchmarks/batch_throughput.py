r"""
Throughput by batch size: HF batched greedy against this runtime's batched decoding, side by side in one process.

For each batch size, the same prompts are answered in batches of that size by HF `generate` (left padding,
greedy) and by each method (a drafter from the registry, `plain` for no drafts); the table gives total new tokens
over wall time, the ratio to HF at that batch size, and tokens per forward. The tree that pays shrinks as the
batch grows: a forward over B rows of T nodes costs more as B * T grows, while each row still commits only its
own accepted tokens. `configs/batching.json` holds the choice made from this table.

    python benchmarks/batch_throughput.py --prompts benchmarks/prompts.jsonl --limit 16 --batch-sizes 1,4,16 \
        --methods plain,medusa:chain-4,medusa:cpu-8,medusa+ngram:cpu-16 --dtype bfloat16 --out bench-out/batch
"""

import argparse
import json
import time
from pathlib import Path

import torch

from medusa_heads import MedusaModel
from medusa_heads.apps.bench import read_bench_prompts
from medusa_heads.backbone import compile_backbone, load_tokenizer
from medusa_heads.inference import Request, decode, make_drafters
from medusa_heads.inference.generate import encode_prompt, eos_token_ids
from medusa_heads.packing import stock_linears


def hf_batch(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> int:
    """New tokens HF greedy generates for one left-padded batch (up to each row's EOS)."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with stock_linears(model.backbone):
        out = model.backbone.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                      pad_token_id=pad)[:, width:]
    eos = set(eos_token_ids(model, tokenizer))
    count = 0
    for row in out.tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        count += ends[0] + 1 if ends else len(row)
    return count


def ours_batch(model, prompts: list[list[int]], method: str, max_new_tokens: int, eos) -> tuple[int, list[float]]:
    """(new tokens, each row's tokens per tree step) of one batch decoded by `method` (NAME[:TREE])."""
    name, _, tree = method.partition(":")
    drafters = make_drafters(model, name, len(prompts), **({"tree": tree} if tree else {}))
    requests = [Request(p, d, max_new_tokens=max_new_tokens) for p, d in zip(prompts, drafters)]
    tokens = sum(len(t) for _, t in decode(model, requests, eos))
    return tokens, [r.stats.mean_accepted_length for r in requests if r.stats.steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--methods", default="plain,medusa:chain-4,medusa:cpu-8,medusa+ngram:cpu-16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", help="compile the backbone's decoder first with this torch.compile mode "
                        "(`default`, or `reduce-overhead` for CUDA graphs); HF and the runtime both use it")
    parser.add_argument("--out", type=Path, default=Path("bench-out/batch"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    # inductor cannot lower the linear layers packed for oneDNN: a compiled model is loaded without packing
    model = MedusaModel.from_pretrained(None, dtype=args.dtype, device=args.device, pack_weights=not args.compile)
    if args.compile:
        model.requires_grad_(False)
        compile_backbone(model.backbone, None if args.compile == "default" else args.compile)
    tokenizer = load_tokenizer(model.config.base_model_name_or_path, gguf_file=model.config.base_model_gguf_file)
    prompts = [encode_prompt(tokenizer, row["prompt"])[0].tolist()
               for row in read_bench_prompts(args.prompts, args.limit)]
    eos = eos_token_ids(model, tokenizer)
    methods = args.methods.split(",")
    rows = []
    for size in [int(b) for b in args.batch_sizes.split(",")]:
        batches = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        seconds = {m: 0.0 for m in ["hf"] + methods}
        tokens = {m: 0 for m in seconds}
        accepted = {m: [] for m in methods}
        for batch in batches:  # methods interleaved batch by batch: drift spreads over all of them
            for method in seconds:
                start = time.perf_counter()
                if method == "hf":
                    tokens[method] += hf_batch(model, tokenizer, batch, args.max_new_tokens)
                else:
                    new, lengths = ours_batch(model, batch, method, args.max_new_tokens, eos)
                    tokens[method] += new
                    accepted[method] += lengths
                seconds[method] += time.perf_counter() - start
        hf_rate = tokens["hf"] / seconds["hf"]
        for method in seconds:
            rate = tokens[method] / seconds[method]
            row = {"batch": size, "method": method, "tokens": tokens[method], "seconds": round(seconds[method], 2),
                   "tokens_per_s": round(rate, 1), "vs_hf": round(rate / hf_rate, 3),
                   "tokens_per_step": round(sum(accepted[method]) / len(accepted[method]), 2)
                   if accepted.get(method) else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_throughput.json").write_text(json.dumps(
        {"dtype": args.dtype, "device": args.device, "compile": args.compile, "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
         "prompts": len(prompts), "rows": rows}, indent=1) + "\n")
    print("\n| batch | method | tokens/s | vs HF batched greedy | tokens per step per row |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['method']} | {r['tokens_per_s']} | {r['vs_hf']:.2f}x | "
              f"{r['tokens_per_step'] if r['tokens_per_step'] is not None else '-'} |")


if __name__ == "__main__":
    main()
