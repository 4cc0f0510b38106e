"""What flows through one decoding step: `DecodeState` -> a drafter -> `Draft` -> an acceptance rule -> `Accepted`."""

from dataclasses import dataclass
from typing import Protocol

import torch

from medusa_heads.tree import TreeBuffers


@dataclass
class DecodeState:
    """What a drafter may look at: the sequence so far and the hidden state that produced `root`."""

    token_ids: list[int]  # prompt + committed tokens, `root` last
    root: int  # the newest committed token, not yet in the KV cache
    hidden: torch.Tensor  # [H] last hidden state at the position that predicted `root`
    # [n, H] the hidden states of the positions committed since the last step (all prompt positions after the
    # prefill), `hidden` last: for drafters that keep their own view of the context
    fresh_hidden: torch.Tensor | None = None


@dataclass
class Draft:
    tree: TreeBuffers
    tokens: torch.Tensor  # [T] long, node 0 is the root


@dataclass
class Accepted:
    nodes: torch.Tensor  # [n + 1] long, tree node ids from the root to the last accepted node
    bonus: int  # the token chosen after the last accepted node

    @property
    def depth(self) -> int:
        """Drafted tokens accepted (the root not counted)."""
        return self.nodes.numel() - 1


class Drafter(Protocol):
    tree: TreeBuffers  # the largest tree it proposes: sizes the context check and the per-depth statistics

    def propose(self, state: DecodeState) -> Draft: ...

    # Optional: `observe(draft, accepted)`, called by the decoding loop after each step's acceptance.


class Acceptance(Protocol):
    def first_token(self, logits: torch.Tensor) -> int: ...

    def accept(self, draft: Draft, logits: torch.Tensor) -> Accepted: ...
