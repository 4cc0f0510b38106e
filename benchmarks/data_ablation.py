"""What each data source adds: the same recipe trained for the same steps on the template answers alone, then with
each further source, each drafter scored on the benchmark prompts (which no source saw).

    python benchmarks/data_ablation.py --config configs/smollm2-135m-eagle3.yaml --steps 400 \
        --sources runs/distill/mix/template_greedy.jsonl runs/distill/mix/self_greedy.jsonl \
                  runs/distill/mix/self_turn2_greedy.jsonl runs/distill/mix/self_sampled.jsonl \
        --out runs/ablation

Run i trains on the first i sources (a folder of links to them under `--out`); everything else is the recipe's,
so at equal steps a run with more sources sees fewer repeats of each conversation, not more updates. Each run's
held-out accuracies come from the recipe's `eval_data`; its tokens per forward on the benchmark prompts come from
`replay_acceptance.py` (greedy verification replayed on the backbone's own outputs, within a few percent of
`medusa-heads bench`). Finished runs are kept and not trained again, so an interrupted ablation resumes.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPLAY = Path(__file__).with_name("replay_acceptance.py")


def train(config: Path, sources: list[Path], steps: int, out: Path) -> Path:
    """Trains the recipe on `sources` for `steps` steps in `out` -> the saved heads (kept from an earlier run)."""
    heads = out / "run" / "heads"
    if (heads / "head_accuracies.json").is_file():
        return heads
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for source in sources:
        link = data / source.name
        if not link.exists():
            link.symlink_to(source.resolve())
    subprocess.run([sys.executable, "-m", "medusa_heads.training", "--config", str(config), "--data", str(data),
                    "--max_steps", str(steps), "--eval_every", str(steps), "--checkpoint_every", str(10 * steps),
                    "--output_dir", str(out / "run")], check=True)
    return heads


def tokens_per_forward(heads: Path, prompts: Path, outputs: Path, drafter: str, tree: str) -> float:
    """`replay_acceptance.py`'s overall tokens per forward for these heads on the benchmark prompts."""
    result = subprocess.run([sys.executable, str(REPLAY), "--prompts", str(prompts), "--outputs", str(outputs),
                             "--heads", str(heads), "--drafter", drafter, "--tree", tree],
                            check=True, capture_output=True, text=True)
    return float(re.search(r"([\d.]+) tokens per forward", result.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the recipe every run shares")
    parser.add_argument("--sources", type=Path, nargs="+", required=True, help="jsonl files, in the order added")
    parser.add_argument("--steps", type=int, required=True, help="training steps of every run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, default=Path("../shared/bench/prompts.jsonl"))
    parser.add_argument("--outputs", type=Path, default=Path("runs/bench_greedy_bf16.jsonl"),
                        help="cache of the backbone's greedy outputs on the prompts (made when missing)")
    parser.add_argument("--drafter", default="medusa")
    parser.add_argument("--tree", default="eagle-cpu-16")
    args = parser.parse_args()
    missing = [str(s) for s in args.sources if not s.is_file()]
    if missing:
        parser.exit(2, f"data_ablation: error: no such data file: {', '.join(missing)}\n")
    rows = []
    for i in range(1, len(args.sources) + 1):
        sources = args.sources[:i]
        name = "+".join(s.stem for s in sources)
        heads = train(args.config, sources, args.steps, args.out / f"{i}-{sources[-1].stem}")
        top1 = json.loads((heads / "head_accuracies.json").read_text())["top1"]
        rows.append({"sources": name, "conversations": sum(1 for s in sources for _ in s.open()),
                     "held_out_top1": [round(a, 3) for a in top1],
                     "tokens_per_forward": tokens_per_forward(heads, args.prompts, args.outputs, args.drafter,
                                                              args.tree)})
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "ablation.json").write_text(json.dumps(rows, indent=1))
    print(f"| sources | conversations | held-out top-1 by depth | tokens per forward ({args.drafter}:{args.tree}) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['sources']} | {r['conversations']} | {', '.join(map(str, r['held_out_top1']))} "
              f"| {r['tokens_per_forward']:.2f} |")


if __name__ == "__main__":
    main()
