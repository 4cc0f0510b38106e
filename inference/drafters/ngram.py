"""Prompt lookup: chains copied from earlier in the sequence (or from the heads' n-gram store), alone or as one more
branch of the heads' tree, verified in the same forward."""

from typing import Protocol

import torch

from medusa_heads.errors import MedusaError
from medusa_heads.ngram_store import NgramStore
from medusa_heads.tree import TreeBuffers, build_tree, canonical_tree, chain_tree

from ..draft import DecodeState, Draft
from .dynamic import DynamicDrafter


class TreeFiller(Protocol):
    """A drafter that can fill any tree containing its own (`MedusaDrafter`, `EagleDrafter`)."""

    tree: TreeBuffers

    def fill(self, state: DecodeState, tree: TreeBuffers) -> torch.Tensor: ...

    def propose(self, state: DecodeState) -> Draft: ...


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


class NgramChain:
    """The n-gram branch that the `...+ngram` drafters add to a tree: `length` tokens from prompt lookup, else from
    `store` (if given), under the root as the branch of rank `branch`."""

    def __init__(self, length: int, max_ngram: int, min_ngram: int, store: NgramStore | None):
        if length < 1:
            raise MedusaError(f"The n-gram chain needs at least 1 token, got {length}.")
        self.length, self.max_ngram, self.min_ngram, self.store = length, max_ngram, min_ngram, store

    def paths(self, branch: int) -> list[tuple[int, ...]]:
        return [tuple([branch] + [0] * d) for d in range(self.length)]

    def follow(self, state: DecodeState) -> list[int]:
        """The chain's tokens for this step; [] when neither the context nor the store has a continuation."""
        follow = ngram_lookup(state.token_ids, self.length, self.max_ngram, self.min_ngram)
        if not follow and self.store is not None:
            follow = self.store.continuation(state.token_ids, self.length)
        return follow


class MedusaNgramDrafter:
    r"""
    The heads' tree (filled by `heads`, a `MedusaDrafter` or an `EagleDrafter`) plus one extra branch from the
    root: a chain of n-gram (prompt lookup) candidates.

    Both are verified in the same forward; when the sequence so far has no matching n-gram, the chain comes from
    `store` (the backbone's frequent continuations in its training answers) if given, else the plain Medusa tree
    is used that step. Greedy output stays exact: acceptance does not care where candidates come from.
    """

    def __init__(self, heads: TreeFiller, ngram_length: int = 6, max_ngram: int = 4, min_ngram: int = 2,
                 store: NgramStore | None = None):
        self.chain = NgramChain(ngram_length, max_ngram, min_ngram, store)
        self.heads = heads
        device = heads.tree.depth.device
        branch = heads.tree.top_k  # a rank no head fills marks the n-gram chain
        self.tree = build_tree(list(heads.tree.paths) + self.chain.paths(branch), device)
        self.is_chain = torch.tensor([bool(p) and p[0] == branch for p in ((),) + self.tree.paths], device=device)
        self.chain_nodes = torch.nonzero(self.is_chain).flatten()  # in depth order

    @property
    def per_sequence(self) -> bool:
        return getattr(self.heads, "per_sequence", False)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Draft:
        follow = self.chain.follow(state)
        if not follow:
            return self.heads.propose(state)
        tree = self.tree
        tokens = self.heads.fill(state, tree)  # chain nodes get placeholders, overwritten here
        nodes = self.chain_nodes[: len(follow)]
        tokens[nodes] = torch.tensor(follow, device=tokens.device)
        if len(follow) < len(self.chain_nodes):
            # A short match: repeat its last token; those nodes are simply rejected if wrong.
            tokens[self.chain_nodes[len(follow):]] = follow[-1]
        return Draft(tree, tokens)


class NgramDrafter:
    """Prompt lookup alone: the tokens that followed the latest earlier match of the last n-gram, as a chain."""

    def __init__(self, length: int = 6, max_ngram: int = 4, min_ngram: int = 2,
                 device: str | torch.device = "cpu"):
        self.tree = chain_tree(length, device)
        self.length, self.max_ngram, self.min_ngram = length, max_ngram, min_ngram
        self.device = device

    def propose(self, state: DecodeState) -> Draft:
        follow = ngram_lookup(state.token_ids, self.length, self.max_ngram, self.min_ngram)
        # No match: one guess (the root again) keeps the step a plain one-token step at the cost of one node.
        follow = follow or [state.root]
        tokens = torch.tensor([state.root] + follow, device=self.device)
        return Draft(chain_tree(len(follow), self.device), tokens)


class DynamicNgramDrafter:
    r"""
    A dynamic tree (`DynamicDrafter`, grown anew each step) plus the n-gram chain as one more branch from the root,
    verified in the same forward: the chain's nodes take a rank no grown node has, and the tree is rebuilt each
    step in canonical order (by depth, then path). The chain comes from prompt lookup, else from `store`.
    """

    def __init__(self, dynamic: DynamicDrafter, ngram_length: int = 6, max_ngram: int = 4, min_ngram: int = 2,
                 store: NgramStore | None = None):
        self.chain = NgramChain(ngram_length, max_ngram, min_ngram, store)
        self.dynamic = dynamic
        self.chain_paths = self.chain.paths(dynamic.top_k)  # a rank no grown node has
        self.tree = build_tree(list(dynamic.tree.paths) + self.chain_paths, dynamic.model.device)  # the largest one
        self.per_sequence = dynamic.per_sequence

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Draft:
        draft = self.dynamic.propose(state)
        follow = self.chain.follow(state)
        if not follow:
            return draft
        paths = list(draft.tree.paths) + self.chain_paths[: len(follow)]
        tokens = draft.tokens.tolist() + follow
        order = sorted(range(len(paths)), key=lambda i: (len(paths[i]), paths[i]))
        tree = canonical_tree(tuple(paths[i] for i in order), draft.tokens.device)
        return Draft(tree, torch.tensor([tokens[0]] + [tokens[i + 1] for i in order], device=draft.tokens.device))
