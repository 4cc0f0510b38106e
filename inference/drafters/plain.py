"""`PlainDrafter`: no drafts, one token per forward through the same loop: the baseline, and what a large batch runs
when speculation stops paying."""

import torch

from medusa_heads.tree import canonical_tree

from ..draft import DecodeState, Draft


class PlainDrafter:
    def __init__(self, device: str | torch.device = "cpu"):
        self.tree = canonical_tree((), device)  # the root alone

    def propose(self, state: DecodeState) -> Draft:
        return Draft(self.tree, torch.tensor([state.root], device=self.tree.depth.device))
