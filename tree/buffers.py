"""Tensors describing one tree, built once per (tree, device) and only indexed while decoding.

Node 0 is the root: the token already chosen (the previous step's bonus token). Node i > 0 is
`paths[i - 1]` in canonical order, filled with head `depth - 1`'s candidate of rank `path[-1]`.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

from medusa_heads.errors import MedusaError

from .spec import Path_, validate_tree


@dataclass(frozen=True)
class TreeBuffers:
    paths: tuple[Path_, ...]
    depth: torch.Tensor  # [T] long, 0 for the root; the position offset of each node
    parent: torch.Tensor  # [T] long, -1 for the root
    head: torch.Tensor  # [T] long, head filling each node (depth - 1); 0 for the root, unused
    rank: torch.Tensor  # [T] long, top-k rank within that head; 0 for the root, unused
    mask: torch.Tensor  # [T, T] bool, mask[i, j]: node i may attend to node j (j is i or an ancestor)
    retrieve: torch.Tensor  # [P, D + 1] long, node ids of each root-to-leaf path, padded with 0
    retrieve_valid: torch.Tensor  # [P, D + 1] bool, False on padding
    internal: torch.Tensor  # [I] long, the nodes with children, ascending (the root first, unless it is alone)

    @property
    def size(self) -> int:
        """Nodes including the root: the number of tokens in one verification forward."""
        return self.depth.shape[0]

    @property
    def max_depth(self) -> int:
        return self.retrieve.shape[1] - 1

    @property
    def top_k(self) -> int:
        """How many candidates per head the tree needs (none for the root alone)."""
        return 1 + max((p[-1] for p in self.paths), default=-1)


def build_tree(paths, device: str | torch.device = "cpu") -> TreeBuffers:
    return canonical_tree(validate_tree(paths), device)


def chain_tree(length: int, device: str | torch.device = "cpu") -> TreeBuffers:
    """A root followed by `length` nodes in a line ([0], [0, 0], ...): the tree of a drafter that drafts a chain."""
    if length < 1:
        raise MedusaError(f"The draft length must be at least 1, got {length}.")
    return canonical_tree(tuple((0,) * d for d in range(1, length + 1)), device)


def canonical_tree(paths: tuple[Path_, ...], device: str | torch.device = "cpu") -> TreeBuffers:
    """`build_tree` for paths already valid and in canonical order (as `validate_tree` returns them), unchecked:
    for drafters that grow a new tree every step. `()` is the root alone."""
    return _build(paths, str(torch.device(device)))


@lru_cache(maxsize=256)
def _build(paths: tuple[Path_, ...], device: str) -> TreeBuffers:
    # Plain lists, then one tensor each: per-element tensor writes would cost about 1 ms for 16 nodes.
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    chains = [[0]]  # node ids from the root down to each node
    for i, p in enumerate(paths, 1):
        chains.append(chains[index[p[:-1]]] + [i])
    n = len(chains)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[[i for i, c in enumerate(chains) for _ in c], [j for c in chains for j in c]] = True
    parents = {index[p[:-1]] for p in paths}
    leaves = [c for i, c in enumerate(chains) if i not in parents]
    width = max(len(c) for c in chains)

    def t(values, dtype=torch.long):
        return torch.tensor(values, dtype=dtype, device=device)

    return TreeBuffers(
        paths=paths,
        depth=t([len(c) - 1 for c in chains]),
        parent=t([-1] + [index[p[:-1]] for p in paths]),
        head=t([max(len(c) - 2, 0) for c in chains]),
        rank=t([0] + [p[-1] for p in paths]),
        mask=mask.to(device),
        retrieve=t([c + [0] * (width - len(c)) for c in leaves]),
        retrieve_valid=t([[True] * len(c) + [False] * (width - len(c)) for c in leaves], torch.bool),
        internal=t(sorted(parents)),
    )
