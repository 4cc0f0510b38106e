"""`MedusaDrafter`: the heads' top-k guesses fill a static tree, from the last accepted hidden state."""

from dataclasses import dataclass
from functools import lru_cache

import torch

from medusa_heads.errors import MedusaError
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers

from ..draft import DecodeState, Draft


class MedusaDrafter:
    """Heads run once, on the last accepted hidden state; head d's top-k fill the tree's depth-d nodes."""

    def __init__(self, model: MedusaModel, tree: TreeBuffers):
        model.require_heads("MedusaDrafter")
        if tree.max_depth > model.config.num_heads:
            raise MedusaError(
                f"The tree is {tree.max_depth} deep but the heads are only {model.config.num_heads}: "
                "choose a shallower tree."
            )
        self.model = model
        self.tree = tree

    @torch.no_grad()
    def fill(self, state: DecodeState, tree: TreeBuffers) -> torch.Tensor:
        """Tokens [T] for `tree`'s nodes from the heads' top-k; nodes deeper than the heads or with ranks beyond
        this drafter's top-k (another drafter's branches) get a placeholder for their owner to overwrite."""
        if self.model.heads.reads_tokens:
            return self._fill_by_depth(state, tree)
        logits = self.model.head_logits(state.hidden)  # [K, V_out]: one projection for every head
        top = self.model.heads.token_ids(logits.topk(self.tree.top_k, dim=-1).indices)  # [K, top_k]
        tokens = top[tree.head.clamp(max=top.shape[0] - 1), tree.rank.clamp(max=top.shape[1] - 1)]  # [T]
        tokens[0] = state.root
        return tokens

    def _fill_by_depth(self, state: DecodeState, tree: TreeBuffers) -> torch.Tensor:
        """Path-conditioned heads: depth by depth, one batched head call over the parents of the next depth."""
        tokens = torch.zeros(tree.size, dtype=torch.long, device=tree.depth.device)
        tokens[0] = state.root
        for step in depth_plan(tree.paths, self.tree.top_k, str(tree.depth.device)):
            top, _ = self.model.head_topk(state.hidden, tokens[step.ancestors], step.k)
            tokens[step.children] = top[step.child_row, step.child_rank]
        return tokens

    def propose(self, state: DecodeState) -> Draft:
        return Draft(self.tree, self.fill(state, self.tree))


@dataclass(frozen=True)
class DepthStep:
    """Filling the children at depth d + 1 of a tree: one head call over their parents."""

    ancestors: torch.Tensor  # [N, d + 1] node ids from the root to each parent
    children: torch.Tensor  # [C] node ids of the children
    child_row: torch.Tensor  # [C] each child's parent, as a row of `ancestors`
    child_rank: torch.Tensor  # [C] each child's rank among its parent's guesses
    k: int  # guesses needed per parent


@lru_cache(maxsize=64)
def depth_plan(paths: tuple, top_k: int, device: str) -> list[DepthStep]:
    """Per depth, which nodes the heads fill (every rank on their path below `top_k`) and from which parents."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    ours = [p for p in paths if max(p) < top_k]
    plan = []
    for depth in range(1, max((len(p) for p in ours), default=0) + 1):
        children = [p for p in ours if len(p) == depth]
        parents = list(dict.fromkeys(p[:-1] for p in children))
        row = {q: i for i, q in enumerate(parents)}

        def t(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        plan.append(DepthStep(
            ancestors=t([[index[q[:i]] for i in range(len(q) + 1)] for q in parents]),
            children=t([index[p] for p in children]),
            child_row=t([row[p[:-1]] for p in children]),
            child_rank=t([p[-1] for p in children]),
            k=1 + max(p[-1] for p in children),
        ))
    return plan
