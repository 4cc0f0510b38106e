r"""
The sampling warpers (temperature, top-k, top-p) as the whole step computes them (`sampling.warped_probs`: thresholds
by bisection), eagerly and compiled, against transformers' own warpers (which sort the vocabulary), over the rows of
a tree step and of a plain step, in one process:

    python benchmarks/warpers.py --rows 1,15 --top-k 50 --top-p 0.9

Prints ms a call (medians) and in how many rows both keep as many tokens (which of the equally likely tokens at
top-p's edge they keep may differ, and a token whose mass is within fp32 rounding of the edge: `sampling.py`).
"""

import argparse
import statistics
import time

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from medusa_heads.inference import Warper
from medusa_heads.inference.sampling import warped_probs


def timed(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,15", help="rows a call: a plain step's 1, a tree step's nodes")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warper = Warper(args.temperature, top_k=args.top_k, top_p=args.top_p)
    hf = [TemperatureLogitsWarper(args.temperature)] + ([TopKLogitsWarper(args.top_k)] if args.top_k else []) + (
        [TopPLogitsWarper(args.top_p)] if args.top_p < 1 else [])

    def transformers_warpers(logits):
        scores = logits.float()
        for step in hf:
            scores = step(None, scores)
        return scores.softmax(dim=-1)

    compiled = torch.compile(warped_probs, fullgraph=True, dynamic=False)
    settings = warper.settings("cpu")
    print(f"vocabulary {args.vocab}, temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, "
          f"{args.threads} threads, bf16 logits")
    print("| rows | transformers' warpers, ms | warped_probs, ms | compiled, ms | rows keeping as many |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = (3 * torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows))).bfloat16()
        theirs, ours = transformers_warpers(logits), compiled(logits, settings, *warper.filters)
        same = int(((theirs > 0).sum(dim=-1) == (ours > 0).sum(dim=-1)).sum())
        print(f"| {rows} | {timed(lambda: transformers_warpers(logits), args.repeats):.2f} "
              f"| {timed(lambda: warper.probs(logits), args.repeats):.2f} "
              f"| {timed(lambda: compiled(logits, settings, *warper.filters), args.repeats):.2f} | {same} of {rows} |")


if __name__ == "__main__":
    main()
