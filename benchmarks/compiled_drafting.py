r"""
The EAGLE-3 drafter's static-tree drafting as one compiled graph (`Eagle3TreeDrafter`) against the step-by-step
`EagleDrafter`, side by side in one process: the shipped EAGLE-3 drafter with the n-gram chain on `eagle3-bf16-8`
(the configuration `medusa-heads tune` chose on this project's CPU), prompts interleaved.

    python benchmarks/compiled_drafting.py --prompts 8 --dtype bfloat16

For each drafter: tokens/s, ms a step drafting and verifying (medians over prompts), tokens a step, and how many
answers the two share (greedy: the drafts change only the rounding of the verifying forward).
"""

import argparse
import json
import statistics
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoTokenizer

from medusa_heads import MedusaModel
from medusa_heads.inference import Eagle3TreeDrafter, EagleDrafter, MedusaNgramDrafter, generate, warm_up
from medusa_heads.tree import build_tree, load_tree

PROMPTS = Path(__file__).parent / "prompts.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="benchmark prompts, spread over the categories")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantize-drafter", default="int8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads = resources.files("medusa_heads") / "pretrained" / "smollm2-135m-embedded-eagle3"
    model = MedusaModel.from_pretrained(str(heads), dtype=args.dtype, quantize_drafter=args.quantize_drafter,
                                        compile_step="auto")
    tokenizer = AutoTokenizer.from_pretrained(model.backbone.name_or_path)
    rows = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    prompts = rows[:: max(len(rows) // args.prompts, 1)][: args.prompts]
    tree = build_tree(load_tree("eagle3-bf16-8"))
    drafters = {"EagleDrafter": lambda: MedusaNgramDrafter(EagleDrafter(model, tree)),
                "Eagle3TreeDrafter": lambda: MedusaNgramDrafter(Eagle3TreeDrafter(model, tree))}
    for make in drafters.values():
        warm_up(model, make(), print)
        generate(model, tokenizer, prompts[0], make(), max_new_tokens=32)
    results: dict[str, list] = {name: [] for name in drafters}
    for prompt in prompts:
        for name, make in drafters.items():
            stats = (answer := generate(model, tokenizer, prompt, make(), max_new_tokens=args.max_new_tokens)).stats
            results[name].append((stats.new_tokens / stats.decode_seconds, stats.step_ms["draft"],
                                  stats.step_ms["verify"], stats.mean_accepted_length, answer.token_ids))
    print(f"{args.dtype}, {args.quantize_drafter} drafter weights, {args.threads} threads, {len(prompts)} prompts, "
          f"compiled step: {'yes' if Eagle3TreeDrafter(model, tree).drafts.compiled is not None else 'no'}")
    print("| drafter | tokens/s | drafting ms a step | verifying ms a step | tokens a step |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        medians = [statistics.median(row[i] for row in rows) for i in range(3)]
        print(f"| {name} | {medians[0]:.1f} | {medians[1]:.2f} | {medians[2]:.2f} | "
              f"{statistics.mean(row[3] for row in rows):.2f} |")
    same = sum(a[4] == b[4] for a, b in zip(*results.values()))
    print(f"same answers: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()
