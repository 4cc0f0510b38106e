"""Tensors describing one tree, built once per (tree, device) and only indexed while decoding.

Node 0 is the root: the token already chosen (the previous step's bonus token). Node i > 0 is
`paths[i - 1]` in canonical order, filled with head `depth - 1`'s candidate of rank `path[-1]`.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

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

    @property
    def size(self) -> int:
        """Nodes including the root: the number of tokens in one verification forward."""
        return self.depth.shape[0]

    @property
    def max_depth(self) -> int:
        return self.retrieve.shape[1] - 1

    @property
    def top_k(self) -> int:
        """How many candidates per head the tree needs."""
        return 1 + max(p[-1] for p in self.paths)


def build_tree(paths, device: str | torch.device = "cpu") -> TreeBuffers:
    return _build(validate_tree(paths), str(torch.device(device)))


@lru_cache(maxsize=64)
def _build(paths: tuple[Path_, ...], device: str) -> TreeBuffers:
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    nodes = [()] + list(paths)
    n = len(nodes)
    parent = [-1] + [index[p[:-1]] for p in paths]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(nodes):
        for d in range(len(p) + 1):
            mask[i, index[p[:d]]] = True
    children = {p[:-1] for p in paths}
    leaves = [p for p in nodes if p not in children]
    depth = max(len(p) for p in nodes)
    retrieve = torch.zeros(len(leaves), depth + 1, dtype=torch.long)
    valid = torch.zeros(len(leaves), depth + 1, dtype=torch.bool)
    for row, leaf in enumerate(leaves):
        ids = [index[leaf[:d]] for d in range(len(leaf) + 1)]
        retrieve[row, : len(ids)] = torch.tensor(ids)
        valid[row, : len(ids)] = True

    def t(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return TreeBuffers(
        paths=paths,
        depth=t([len(p) for p in nodes]),
        parent=t(parent),
        head=t([max(len(p) - 1, 0) for p in nodes]),
        rank=t([p[-1] if p else 0 for p in nodes]),
        mask=mask.to(device),
        retrieve=retrieve.to(device),
        retrieve_valid=valid.to(device),
    )
