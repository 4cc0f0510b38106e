r"""
The whole step as one compiled graph, as a frozen package compiled ahead of time (`frozen_step.py`, where the CPU
has AMX) and as an in-process graph over oneDNN's packed products (`static_step.py`), against the same step driven
from the host around the compiled forward (`decode_step`), side by side in one process, prompts interleaved: for
the default configuration (the shipped Hydra heads, `medusa+ngram` on `hydra-cpu-6`) and for plain decoding (the
step of the root alone); or for other heads, as the tuned EAGLE-3 configuration; on a GPU, the whole step replayed
as CUDA graphs (`captured_step.py`) against the host-driven step:

    python benchmarks/whole_step.py --prompts 16 --dtype bfloat16
    python benchmarks/whole_step.py --heads smollm2-135m-embedded-eagle3 --tree eagle3-bf16-8 --quantize-drafter int8
    python benchmarks/whole_step.py --device cuda --tree medusa-63
    python benchmarks/whole_step.py --acceptance exact   # at --temperature 0.7, a prompt's seed the same each way
    python benchmarks/whole_step.py --acceptance exact --top-k 50 --top-p 0.9

For each way: tokens/s and ms a step (medians over prompts), tokens a step, and how many answers equal the
first row's (greedy: every way gives the backbone's greedy answer, up to bf16 rounding in the forward; sampling:
every way draws the same random numbers, so answers differ only where that rounding tips a draw). With
`--profile`, then where the whole step's time goes: torch.profiler's operators over one answer, by self CPU time.
"""

import argparse
import importlib
import json
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoTokenizer

from medusa_heads import MedusaModel
from medusa_heads.backbone import weight_bytes
from medusa_heads.fast_llama import FAST_FORWARD
from medusa_heads.inference import frozen_step, generate, make_acceptance, make_drafter, warm_up
from medusa_heads.inference.static_step import StaticSteps, heads_of, step_rule, step_trees

PROMPTS = Path(__file__).parent / "prompts.jsonl"
PRETRAINED = Path(__file__).parents[1] / "medusa_heads" / "pretrained"
generate_module = importlib.import_module("medusa_heads.inference.generate")  # the package exports a function so named


@contextmanager
def stepping(steps: StaticSteps | None):
    """Decoding whole steps through `steps`, or (None) as before the whole-step graphs: `decode_step` around the
    compiled forward."""
    whole = generate_module.static_steps
    generate_module.static_steps = lambda *args: steps
    try:
        yield
    finally:
        generate_module.static_steps = whole


def whole_steps(model: MedusaModel, frozen: bool) -> StaticSteps:
    steps = StaticSteps(model, getattr(model.backbone, FAST_FORWARD))
    steps.frozen = frozen
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="benchmark prompts, spread over the categories")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the whole step replayed as CUDA graphs")
    parser.add_argument("--heads", help="a folder of medusa_heads/pretrained/, or any heads folder (default: the "
                        "heads shipped for the model)")
    parser.add_argument("--quantize-drafter", default="none", choices=["none", "int8", "int4"])
    parser.add_argument("--tree", default="hydra-cpu-6")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--acceptance", default="greedy", choices=["greedy", "exact", "typical"])
    parser.add_argument("--temperature", type=float, default=0.7, help="exact, typical: the temperature")
    parser.add_argument("--top-k", type=int, default=0, help="exact: top-k filtering (0: none)")
    parser.add_argument("--top-p", type=float, default=1.0, help="exact: nucleus mass (1: none)")
    parser.add_argument("--profile", action="store_true", help="then profile the whole step over one answer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads = args.heads and (PRETRAINED / args.heads if (PRETRAINED / args.heads).is_dir() else args.heads)
    model = MedusaModel.from_pretrained(heads, dtype=args.dtype, device=args.device, compile_step="auto",
                                        quantize_drafter=args.quantize_drafter)
    tokenizer = AutoTokenizer.from_pretrained(model.backbone.name_or_path)
    rows = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    prompts = rows[:: max(len(rows) // args.prompts, 1)][: args.prompts]
    tree_drafter, plain = make_drafter(model, "medusa+ngram", tree=args.tree), make_drafter(model, "plain")
    frozen = frozen_step.applies(model)
    graph = "CUDA graph" if args.device.startswith("cuda") else "in-process graph"
    ways = {"whole step, frozen package": (tree_drafter, whole_steps(model, frozen=True)),
            f"whole step, {graph}": (tree_drafter, whole_steps(model, frozen=False)),
            "host-driven step": (tree_drafter, None),
            "plain, whole step, frozen package": (plain, whole_steps(model, frozen=True)),
            f"plain, whole step, {graph}": (plain, whole_steps(model, frozen=False)),
            "plain, host-driven (the forward alone)": (plain, None)}
    ways = {way: spec for way, spec in ways.items() if frozen or "frozen" not in way}

    def acceptance(seed: int = 0):
        if args.acceptance == "greedy":
            return None
        filters = dict(top_k=args.top_k, top_p=args.top_p) if args.acceptance == "exact" else {}
        return make_acceptance(args.acceptance, args.temperature, seed=seed, device=args.device, **filters)

    def run(prompt: str, way: str, tokens: int):
        drafter, steps = ways[way]
        with stepping(steps):
            return generate(model, tokenizer, prompt, drafter, acceptance(prompts.index(prompt)), max_new_tokens=tokens)

    for way, (drafter, steps) in ways.items():
        with stepping(steps):
            warm_up(model, drafter, print, acceptance())
        run(prompts[0], way, 32)
    results: dict[str, list] = {way: [] for way in ways}
    for prompt in prompts:
        for way in ways:
            answer = run(prompt, way, args.max_new_tokens)
            stats = answer.stats
            results[way].append((stats.new_tokens / stats.decode_seconds, 1000 * stats.decode_seconds / stats.steps,
                                 stats.mean_accepted_length, answer.token_ids))
    sampling = f"{args.acceptance} acceptance" + (f" at temperature {args.temperature}" if acceptance() else "")
    if args.acceptance == "exact" and (args.top_k or args.top_p < 1):
        sampling += f", top-k {args.top_k}, top-p {args.top_p}"
    print(f"{args.dtype}, {args.threads} threads, {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"tree {args.tree} + n-gram chain, {sampling}")
    print("| decoding | tokens/s | ms a step | tokens a step | answers equal to the first row's |")
    print("|---|---|---|---|---|")
    first = next(iter(results.values()))
    for way, rows in results.items():
        same = sum(a[3] == b[3] for a, b in zip(first, rows))
        print(f"| {way} | {statistics.median(r[0] for r in rows):.1f} | {statistics.median(r[1] for r in rows):.2f} "
              f"| {statistics.mean(r[2] for r in rows):.2f} | {same} of {len(rows)} |")
    if frozen:
        rule = step_rule(acceptance())
        sizes = [frozen_step.package_path(model, tree, heads_of(drafter).tree.top_k, nodes is not None, rule)
                 .stat().st_size
                 for drafter in (tree_drafter, plain) for tree, nodes in step_trees(drafter)]
        print(f"\nThe frozen packages: {', '.join(f'{size / 1e6:.0f}' for size in sizes)} MB on disk, the backbone's "
              f"weights {weight_bytes(model.backbone) / 1e6:.0f} MB")
    if args.profile:
        with torch.profiler.profile() as profiler:
            stats = run(prompts[0], next(iter(ways)), args.max_new_tokens).stats
        print(f"\nThe whole step over one answer ({stats.steps} steps, {1000 * stats.decode_seconds / stats.steps:.2f} "
              "ms a step under the profiler):\n")
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
