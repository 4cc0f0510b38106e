"""Train Medusa heads: `accelerate launch -m medusa_heads.training --config configs/RECIPE.yaml [--key value ...]`.

Runs the same without `accelerate launch` in one process. `--resume` continues from the last checkpoint
in the recipe's `output_dir`.
"""

import argparse
import logging
import sys

from medusa_heads.backbone import first_line
from medusa_heads.errors import MedusaError

from .recipe import load_recipe
from .trainer import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medusa_heads.training", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML recipe (configs/*.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    args, rest = parser.parse_known_args(argv)
    if len(rest) % 2 or any(not k.startswith("--") for k in rest[::2]):
        parser.error("overrides come as --key value pairs")
    overrides = {k[2:].replace("-", "_"): v for k, v in zip(rest[::2], rest[1::2])}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        train(load_recipe(args.config, overrides), resume=args.resume)
    except MedusaError as err:
        print(f"medusa-heads train: error: {first_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
