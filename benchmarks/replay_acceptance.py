"""Tokens per forward of a drafter, replayed offline on the backbone's known greedy outputs (no verification).

    python benchmarks/replay_acceptance.py --prompts benchmarks/prompts.jsonl --outputs runs/bench_greedy.jsonl \
        --drafter medusa+ngram+store --tree cpu-16 [--heads PATH]

Greedy verification accepts the longest tree path that spells the backbone's own continuation, so with that
continuation known (generated once with HF greedy, cached in `--outputs`) a step needs only the drafter: one
backbone forward over each whole sequence gives every hidden state the loop would hand it. Accepted lengths
match tree decoding up to the rounding differences between a full forward and the incremental ones (bf16);
use it to compare drafters and trees in seconds, then confirm with `medusa-heads bench`.
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads import MedusaModel
from medusa_heads.apps.bench import read_bench_prompts
from medusa_heads.apps.calibrate import replay
from medusa_heads.backbone import load_tokenizer
from medusa_heads.errors import MedusaError, read_jsonl
from medusa_heads.inference import DRAFTERS, make_drafter
from medusa_heads.inference.generate import encode_prompt


def greedy_outputs(model, prompts: list[dict], path: Path, max_new_tokens: int) -> list[dict]:
    """HF greedy token ids per prompt, generated once and cached in `path` (jsonl)."""
    done = {}
    if path.exists():
        done = {row["id"]: row for _, row in read_jsonl(path, "Greedy outputs cache", "output_ids", list)}
    tokenizer = load_tokenizer(model.config.base_model_name_or_path, model.config.base_model_gguf_file)
    with path.open("a") as out:
        for p in tqdm([p for p in prompts if p["id"] not in done], desc="greedy outputs", unit="prompt"):
            ids = encode_prompt(tokenizer, p["prompt"]).to(model.device)
            new = model.backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=max_new_tokens)[0, ids.shape[1]:]
            done[p["id"]] = {"id": p["id"], "prompt_ids": ids[0].tolist(), "output_ids": new.tolist()}
            out.write(json.dumps(done[p["id"]]) + "\n")
    return [{**done[p["id"]], "category": p["category"]} for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--outputs", type=Path, required=True, help="jsonl cache of the greedy outputs")
    parser.add_argument("--heads", help="heads folder (default: the shipped ones)")
    parser.add_argument("--drafter", choices=list(DRAFTERS), default="medusa+ngram+store")
    parser.add_argument("--tree", default="cpu-16")
    parser.add_argument("--draft-length", type=int, help="tokens in the n-gram chain (default 6)")
    parser.add_argument("--budget", type=int, help="nodes of a dynamic tree (default 16)")
    parser.add_argument("--depth", type=int, help="the deepest a dynamic tree grows (default: the number of heads)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = MedusaModel.from_pretrained(args.heads, dtype=args.dtype)
        rows = greedy_outputs(model, read_bench_prompts(args.prompts), args.outputs, args.max_new_tokens)
        takes = DRAFTERS[args.drafter].options
        drafter = make_drafter(model, args.drafter, tree=args.tree if "tree" in takes else None,
                               draft_length=args.draft_length, budget=args.budget, depth=args.depth)
    except MedusaError as err:
        parser.exit(2, f"replay_acceptance: error: {err}\n")
    tokens, steps = defaultdict(int), defaultdict(int)
    for row in tqdm(rows, desc="replay", unit="prompt"):
        # the first new token comes from the prefill; each step commits its accepted path and one more token
        tokens[row["category"]] += len(row["output_ids"]) - 1
        steps[row["category"]] += replay(model, drafter, row["prompt_ids"], row["output_ids"])
    total = sum(tokens.values()) / sum(steps.values())
    chain = f":{args.draft_length}" if args.draft_length else ""
    shape = f"{args.budget or 16} nodes" if "budget" in takes else args.tree
    shape += f", {args.depth} deep" if args.depth else ""
    print(f"{args.drafter}:{shape}{chain} ({args.heads or 'shipped heads'}): {total:.3f} tokens per forward; "
          + ", ".join(f"{c} {tokens[c] / steps[c]:.2f}" for c in tokens))


if __name__ == "__main__":
    main()
