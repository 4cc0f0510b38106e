"""Sources of candidate tokens. A drafter fills a tree with one token per node; the root is already chosen."""

from dataclasses import dataclass
from typing import Protocol

import torch

from medusa_heads.errors import MedusaError
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers


@dataclass
class DecodeState:
    """What a drafter may look at: the sequence so far and the hidden state that produced `root`."""

    token_ids: list[int]  # prompt + committed tokens, `root` last
    root: int  # the newest committed token, not yet in the KV cache
    hidden: torch.Tensor  # [H] last hidden state at the position that predicted `root`


@dataclass
class Draft:
    tree: TreeBuffers
    tokens: torch.Tensor  # [T] long, node 0 is the root


class Drafter(Protocol):
    def propose(self, state: DecodeState) -> Draft: ...


class MedusaDrafter:
    """Heads run once, on the last accepted hidden state; head d's top-k fill the tree's depth-d nodes."""

    def __init__(self, model: MedusaModel, tree: TreeBuffers):
        if tree.max_depth > model.config.num_heads:
            raise MedusaError(
                f"The tree is {tree.max_depth} deep but the heads are only {model.config.num_heads}: "
                "choose a shallower tree."
            )
        self.model = model
        self.tree = tree

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Draft:
        logits = self.model.head_logits(state.hidden)  # [K, V]
        top = logits.topk(self.tree.top_k, dim=-1).indices  # [K, top_k]
        tokens = top[self.tree.head, self.tree.rank]  # [T]
        tokens[0] = state.root
        return Draft(self.tree, tokens)
