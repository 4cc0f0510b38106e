"""Sources of candidate tokens. A drafter fills a tree with one token per node; the root is already chosen."""

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import torch

from medusa_heads.errors import MedusaError
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers

from .ngram_store import STORE_FILE, NgramStore, find_store


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


class Drafter(Protocol):
    tree: TreeBuffers  # the largest tree it proposes: sizes the context check and the per-depth statistics

    def propose(self, state: DecodeState) -> Draft: ...

    # Optional: `observe(draft, accepted)`, called by the decoding loop after each step's acceptance.


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
        if self.model.heads.is_hydra:
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


def ngram_lookup(token_ids: list[int], length: int, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """Prompt lookup: the `length` tokens that followed the latest earlier match of the sequence's last n-gram
    (longest n first). Empty when nothing matches."""
    n_tokens = len(token_ids)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n_tokens <= n:
            continue
        tail = token_ids[-n:]
        for start in range(n_tokens - n - 1, -1, -1):
            if token_ids[start : start + n] == tail:
                follow = token_ids[start + n : start + n + length]
                if follow:
                    return follow
    return []


class MedusaNgramDrafter:
    r"""
    The Medusa tree plus one extra branch from the root: a chain of n-gram (prompt lookup) candidates.

    Both are verified in the same forward; when the sequence so far has no matching n-gram, the chain comes from
    `store` (the backbone's frequent continuations in its training answers) if given, else the plain Medusa tree
    is used that step. Greedy output stays exact: acceptance does not care where candidates come from.
    """

    def __init__(self, model: MedusaModel, paths, ngram_length: int = 6, max_ngram: int = 4, min_ngram: int = 2,
                 store: NgramStore | None = None):
        from medusa_heads.tree import build_tree, validate_tree

        if ngram_length < 1:
            raise MedusaError(f"The n-gram chain needs at least 1 token, got {ngram_length}.")
        paths = validate_tree(paths, num_heads=model.config.num_heads)
        self.medusa = heads_drafter(model, build_tree(paths, model.device))
        branch = self.medusa.tree.top_k  # a rank no head fills marks the n-gram chain
        chain = [tuple([branch] + [0] * d) for d in range(ngram_length)]
        self.tree = build_tree(list(paths) + chain, model.device)
        self.is_chain = torch.tensor([bool(p) and p[0] == branch for p in ((),) + self.tree.paths],
                                     device=model.device)
        self.chain_nodes = torch.nonzero(self.is_chain).flatten()  # in depth order
        self.ngram_length, self.max_ngram, self.min_ngram = ngram_length, max_ngram, min_ngram
        self.store = store

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Draft:
        follow = ngram_lookup(state.token_ids, self.ngram_length, self.max_ngram, self.min_ngram)
        if not follow and self.store is not None:
            follow = self.store.continuation(state.token_ids, self.ngram_length)
        if not follow:
            return self.medusa.propose(state)
        tree = self.tree
        tokens = self.medusa.fill(state, tree)  # chain nodes get placeholders, overwritten here
        nodes = self.chain_nodes[: len(follow)]
        tokens[nodes] = torch.tensor(follow, device=tokens.device)
        if len(follow) < len(self.chain_nodes):
            # A short match: repeat its last token; those nodes are simply rejected if wrong.
            tokens[self.chain_nodes[len(follow):]] = follow[-1]
        return Draft(tree, tokens)


def heads_drafter(model: MedusaModel, tree: TreeBuffers) -> Drafter:
    """The drafter for the model's own heads on a static tree: `MedusaDrafter`, or `EagleDrafter` for EAGLE."""
    if model.is_eagle:
        from .eagle import EagleDrafter

        return EagleDrafter(model, tree)
    return MedusaDrafter(model, tree)


def make_drafter(model: MedusaModel, tree_name_or_file: str, ngram: bool = False, name: str | None = None,
                 budget: int | None = None, **options) -> Drafter:
    """The CLI's drafters by name: the Medusa tree, optionally with an n-gram branch of `draft_length`
    tokens (default 6; `ngram` or `name="medusa+ngram"`; `"medusa+ngram+store"` falls back to the heads'
    `NgramStore`); `dynamic` and `adaptive` grow their tree each step within `budget` nodes (`dynamic.py`);
    other names (ngram, draft-model, early-exit) are `draft_model.py`'s, given `options`."""
    from medusa_heads.tree import build_tree, load_tree

    if name in ("dynamic", "adaptive"):
        from .dynamic import make_dynamic_drafter

        return make_dynamic_drafter(model, name, budget)
    if name not in (None, "medusa", "medusa+ngram", "medusa+ngram+store"):
        from .draft_model import make_headless_drafter

        return make_headless_drafter(model, name, **options)
    paths = load_tree(tree_name_or_file)
    chain = {"ngram_length": options["draft_length"]} if options.get("draft_length") is not None else {}
    if name == "medusa+ngram+store":
        return MedusaNgramDrafter(model, paths, store=heads_store(model), **chain)
    if ngram or name == "medusa+ngram":
        return MedusaNgramDrafter(model, paths, **chain)
    return heads_drafter(model, build_tree(paths, model.device))


def heads_store(model: MedusaModel) -> NgramStore:
    """The n-gram store saved with the model's heads; a one-line error when they have none."""
    heads_path = model.heads.name_or_path
    store = find_store(str(heads_path))
    if store is None:
        raise MedusaError(f"The heads `{heads_path or '(in memory)'}` have no {STORE_FILE}: build one with "
                          "`medusa-heads ngram-store DATA --heads FOLDER`.")
    if store.vocab_size != model.config.vocab_size:
        raise MedusaError(f"The n-gram store of `{heads_path}` is for a vocabulary of {store.vocab_size} tokens, "
                          f"the heads have {model.config.vocab_size}.")
    return store
