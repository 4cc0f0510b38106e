"""A tree is a list of paths of top-k ranks: `[0, 1]` is head 1's top-1 then head 2's top-2."""

from importlib import resources
from pathlib import Path
from typing import Sequence

from medusa_heads.errors import MedusaError, read_json

Path_ = tuple[int, ...]


def _trees_folder() -> Path:
    return Path(str(resources.files("medusa_heads.configs") / "trees"))


def tree_names() -> list[str]:
    return sorted(p.stem for p in _trees_folder().glob("*.json"))


def validate_tree(paths: Sequence[Sequence[int]], num_heads: int | None = None,
                  top_k: int | None = None) -> tuple[Path_, ...]:
    """Check a tree spec and return it in canonical order (by depth, then ranks); raise MedusaError if broken."""
    if not isinstance(paths, (list, tuple)) or not paths:
        raise MedusaError("A tree must be a non-empty list of paths such as [[0], [0, 0], [1]].")
    canonical = []
    for p in paths:
        ranks_ok = isinstance(p, (list, tuple)) and all(isinstance(r, int) and not isinstance(r, bool) for r in p)
        if not p or not ranks_ok:
            raise MedusaError(f"Tree path {p!r} is not a non-empty list of integer ranks.")
        canonical.append(tuple(p))
    seen = set()
    for p in canonical:
        if p in seen:
            raise MedusaError(f"Tree path {list(p)} appears twice.")
        seen.add(p)
    for p in canonical:
        if min(p) < 0:
            raise MedusaError(f"Tree path {list(p)} has a negative rank.")
        if top_k is not None and max(p) >= top_k:
            raise MedusaError(f"Tree path {list(p)} uses rank {max(p)}, but only the top {top_k} of each head are "
                              "asked for.")
        if num_heads is not None and len(p) > num_heads:
            raise MedusaError(f"Tree path {list(p)} is {len(p)} deep, but there are only {num_heads} heads.")
        if len(p) > 1 and p[:-1] not in seen:
            raise MedusaError(f"Tree path {list(p)} has no parent: add {list(p[:-1])}.")
    return tuple(sorted(canonical, key=lambda p: (len(p), p)))


def load_tree(name_or_file: str | Path) -> tuple[Path_, ...]:
    """Read a tree from a JSON file or by the name of a shipped one (`configs/trees/NAME.json`).

    The file holds a list of paths, or an object whose `paths` key does (other keys are metadata).
    """
    path = Path(name_or_file)
    if not path.suffix and not path.exists():
        path = _trees_folder() / f"{name_or_file}.json"
        if not path.exists():
            raise MedusaError(f"Unknown tree `{name_or_file}`: give a JSON file or one of {', '.join(tree_names())}.")
    data = read_json(path, "Tree file", str(name_or_file))
    paths = data.get("paths") if isinstance(data, dict) else data
    return validate_tree(paths)
