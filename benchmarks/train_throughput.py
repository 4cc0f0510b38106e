"""Head-training throughput with and without the hidden-state cache, side by side on the same data.

    python benchmarks/train_throughput.py --config configs/smollm2-135m.yaml --steps 20 --threads 1

Both runs train the same heads on the same batches; the cached run builds the frozen backbone's hidden
states once into a fresh folder (its wall time includes that build), the other recomputes them every step.
Tokens per second count training steps only.
"""

import argparse
import json
import tempfile
import time

import torch

from medusa_heads.training.recipe import load_recipe
from medusa_heads.training.trainer import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data", help="override the recipe's data")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    warmup = min(load_recipe(args.config).warmup_steps, args.steps)  # a short run may end inside the warm-up
    for cached in (True, False):
        with tempfile.TemporaryDirectory() as out:
            overrides = {"max_steps": args.steps, "warmup_steps": warmup, "output_dir": out,
                         "cache_hidden_states": cached, "eval_every": 10 ** 9, "checkpoint_every": 10 ** 9,
                         "held_out_fraction": 0.0, "hidden_cache_dir": f"{out}/hidden"}
            if args.data:
                overrides["data"] = args.data
            start = time.perf_counter()
            run = train(load_recipe(args.config, overrides))
            results["cached" if cached else "recomputed"] = {
                "train_tokens_per_second": run["train_tokens_per_second"],
                "wall_seconds_including_setup": time.perf_counter() - start}
    results["speedup_from_cache"] = (results["cached"]["train_tokens_per_second"]
                                     / results["recomputed"]["train_tokens_per_second"])
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
