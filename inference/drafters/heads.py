"""`MedusaDrafter`: the heads' top-k guesses fill a static tree, from the last accepted hidden state."""

from dataclasses import dataclass
from functools import lru_cache

import torch

from medusa_heads.compiled_llama import compilable, with_compilable_linears
from medusa_heads.errors import MedusaError
from medusa_heads.fast_llama import product
from medusa_heads.model import MedusaModel
from medusa_heads.packing import with_plain_linears
from medusa_heads.tree import TreeBuffers

from ..draft import DecodeState, Draft


class HeadsDraft:
    r"""
    The heads' drafting of one static tree as a function of tensors: (last hidden state [H], root [1]) -> tokens
    [T] (`MedusaDrafter.fill`). Its linear layers are called as `linears` says: "packed" (as the model holds
    them), "opaque" (through the operators a graph can hold, `compiled_llama.compilable`, so that a whole-step
    graph drafts too) or "plain" (over plain weights, for a graph that lays weights out itself).
    """

    def __init__(self, model: MedusaModel, tree: TreeBuffers, top_k: int, linears: str = "packed"):
        wrap = compilable if linears == "opaque" else lambda p: p
        twin = {"packed": lambda heads: heads, "opaque": with_compilable_linears, "plain": with_plain_linears}[linears]
        self.heads = twin(model.heads)  # only the one asked for: an opaque twin registers its weights with the operator
        self.tree, self.reads_tokens = tree, model.heads.reads_tokens
        owned = model.heads.owned_projections()
        plain = linears == "plain"
        self.projections = [wrap(product(m, plain)) for m in owned] or [wrap(product(model.projection, plain))]
        self.embed = model.backbone.get_input_embeddings()
        self.top_k, self.size = top_k, tree.size  # graphs do not trace `TreeBuffers`' properties
        self.plan = depth_plan(tree.paths, top_k, str(tree.depth.device)) if self.reads_tokens else None

    def project(self, head: int, states: torch.Tensor) -> torch.Tensor:
        return self.projections[head if len(self.projections) > 1 else 0](states)

    def __call__(self, hidden: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        tree = self.tree
        if self.plan is None:
            states = self.heads.head_states(hidden)  # [K, H]
            logits = self.project(0, states) if len(self.projections) == 1 else \
                torch.stack([self.project(k, s) for k, s in enumerate(states)])  # one product for shared heads
            top = self.heads.token_ids(logits.topk(self.top_k, dim=-1).indices)  # [K, top_k]
            tokens = top[tree.head.clamp(max=top.shape[0] - 1), tree.rank.clamp(max=top.shape[1] - 1)]  # [T]
            return torch.cat([root, tokens[1:]])
        # Path-conditioned heads: depth by depth, one batched head call over the parents of the next depth
        tokens = torch.cat([root, root.new_zeros(self.size - 1)])
        for depth, step in enumerate(self.plan):
            states = self.heads.head_state(depth, hidden, self.embed(tokens[step.ancestors]))
            logprobs = torch.log_softmax(self.project(depth, states).float(), -1)  # as `MedusaModel.head_topk`
            top = self.heads.token_ids(logprobs.topk(step.k).indices)  # [N, k]
            tokens = tokens.index_put((step.children,), top[step.child_row, step.child_rank])
        return tokens


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
        self.drafts: dict[tuple, HeadsDraft] = {}

    def draft(self, tree: TreeBuffers) -> HeadsDraft:
        """The `HeadsDraft` of `tree` (this drafter's own or one holding it)."""
        if tree.paths not in self.drafts:
            self.drafts[tree.paths] = HeadsDraft(self.model, tree, self.tree.top_k)
        return self.drafts[tree.paths]

    @torch.no_grad()
    def fill(self, state: DecodeState, tree: TreeBuffers) -> torch.Tensor:
        """Tokens [T] for `tree`'s nodes from the heads' top-k; nodes deeper than the heads or with ranks beyond
        this drafter's top-k (another drafter's branches) get a placeholder for their owner to overwrite."""
        root = torch.tensor([state.root], device=tree.depth.device)
        return self.draft(tree)(self.model.last_hidden(state.hidden), root)

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
