r"""
`Eagle3TreeDrafter`: an EAGLE-3 drafter that fills a static tree in one function of tensors (`TreeDraft`), compiled
into one graph per tree where the backbone's step is compiled (`compiled_llama.py`).

A step of `EagleDrafter` is a few dozen small products wrapped in hundreds of eager operations and their Python
(the cache's growth, the masks built per depth, the indexing); here the tree's shape is fixed when the function is
made, so every index is a constant, the drafter's keys and values sit in a static cache written at slots computed
from two tensors (where the newly committed positions start, and how many they are), and no Python number is read
from a tensor inside. The committed positions are padded to `FRESH_ROWS` rows so that one graph serves every step;
the prompt (more rows) runs the same function eagerly. Where the whole step is one graph (`static_step.py`), that
graph calls `TreeDraft` itself, over this drafter's cache.
"""

import logging
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from medusa_heads.backbone import first_line
from medusa_heads.compiled_llama import (CompiledLlama, call_graph, compilable, compile_step, mark_cache_dynamic,
                                         why_not_compiled)
from medusa_heads.errors import MedusaError
from medusa_heads.fast_eagle3 import FastEagle3, fast_eagle3_supports
from medusa_heads.fast_llama import FAST_FORWARD
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers

from ..cache import round_up
from ..draft import DecodeState, Draft
from .heads import depth_plan

logger = logging.getLogger(__name__)

FRESH_ROWS = 8  # newly committed positions a compiled step takes, padded; a step with more runs eagerly


@dataclass(frozen=True)
class _Depth:
    """What one depth of a static tree drafts, as constant tensors."""

    parents: torch.Tensor  # [m] the nodes whose children it guesses
    reads: torch.Tensor  # [m] depth >= 1: the node whose output each parent's new entry reads (the parent's parent)
    seen: torch.Tensor  # [m, drafted + m] the speculative entries each new entry sees: its ancestors' and its own
    drafted: int  # speculative entries written before this depth's
    k: int  # guesses per parent
    children: torch.Tensor  # [C] the nodes filled
    child_row: torch.Tensor  # [C] each child's parent, as a row of `parents`
    child_rank: torch.Tensor  # [C] its rank among that parent's guesses


def tree_plan(tree: TreeBuffers, top_k: int) -> list[_Depth]:
    """Per depth, what the drafter computes for `tree`'s nodes of ranks below `top_k` (others' branches get
    placeholders), and which speculative entries each of its new entries sees."""
    device = tree.depth.device
    entry: dict[int, int] = {}  # node -> its speculative entry
    drafted, plan = 0, []
    for depth, step in enumerate(depth_plan(tree.paths, top_k, str(device))):
        ancestors = step.ancestors.tolist()
        m = len(ancestors) if depth else 0
        seen = torch.zeros(m, drafted + m, dtype=torch.bool)
        for row, chain in enumerate(ancestors[:m]):  # its ancestors' entries were made at shallower depths
            seen[row, [entry[node] for node in chain[1:-1]] + [drafted + row]] = True
            entry[chain[-1]] = drafted + row
        plan.append(_Depth(step.ancestors[:, -1], step.ancestors[:, -2 if depth else -1], seen.to(device), drafted,
                           step.k, step.children, step.child_row, step.child_rank))
        drafted += m
    return plan


class TreeDraft:
    r"""
    One static tree's drafting as a function of tensors: the newly committed positions appended to the drafter's
    cache, then depth by depth one entry per node with children (reading its parent's output and its own token,
    seeing the context, its ancestors' entries and itself), its guesses filling the children.
    """

    def __init__(self, fast: FastEagle3, tree: TreeBuffers, top_k: int):
        self.fast, self.size, self.plan = fast, tree.size, tree_plan(tree, top_k)
        self.drafted = sum(depth.seen.shape[0] for depth in self.plan)  # speculative entries a step writes

    def __call__(self, fresh: torch.Tensor, after: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                 root: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        r"""
        Args:
            fresh: [F, W] the backbone's features at the newly committed positions (the first `count` rows real,
                the rest padding), after: [F] the token after each, at positions and slots `start` onwards.
            root: the tree's root token; keys, values: [1, H_kv, window, D] the drafter's cache (a view of its
                first `window` slots), the context in its first `start` slots.

        Returns:
            tokens [T] for the tree's nodes.
        """
        fast, device = self.fast, fresh.device
        slot = torch.arange(keys.shape[2], device=device)
        new = start + torch.arange(fresh.shape[0], device=device)
        out = fast.decode(fresh, after, new, slot[None] <= new[:, None], keys, values, new)
        committed = start + count
        outputs = out.new_zeros(self.size, out.shape[-1])
        outputs[:1] = out[(count - 1).view(1)]  # a tensor index: an integer one would be read on the host
        tokens = torch.zeros(self.size, dtype=torch.long, device=device)
        tokens[0] = root
        speculative = slot - committed  # each slot's place among this step's speculative entries (< 0: context)
        for depth, step in enumerate(self.plan):
            if depth:
                m, width = step.seen.shape
                sees = step.seen[:, speculative.clamp(0, width - 1)] & (speculative < width)[None]
                slots = committed + step.drafted + torch.arange(m, device=device)
                outputs[step.parents] = fast.decode(outputs[step.reads], tokens[step.parents],
                                                    (committed + depth - 1).expand(m), (speculative < 0)[None] | sees,
                                                    keys, values, slots)
            tokens[step.children] = fast.guesses(outputs[step.parents], step.k)[step.child_row, step.child_rank]
        return tokens


class TreeDrafts:
    """A model's `TreeDraft`s, one per tree, eager and (where the backbone's step is compiled) compiled; shared by
    the model's drafters, so graphs are compiled once per process."""

    def __init__(self, model: MedusaModel):
        fast = self.fast = FastEagle3(model.heads, model.backbone.get_input_embeddings())
        self.eager: dict[tuple, TreeDraft] = {}
        self.graphs: dict[tuple, Callable] = {}
        self.ready: set[tuple] = set()  # the keys of `graphs` that have run
        self.compiled: FastEagle3 | None = None  # its products callable from a graph, where drafting compiles
        if isinstance(getattr(model.backbone, FAST_FORWARD, None), CompiledLlama):
            why_not = why_not_compiled(fast.products())
            if why_not:
                logger.warning("Drafting without compiling: %s.", why_not)
            else:
                self.compiled = fast.with_products(compilable)

    def draft(self, tree: TreeBuffers, top_k: int) -> TreeDraft:
        """The eager `TreeDraft` of `tree`'s nodes of ranks below `top_k`."""
        if (tree.paths, top_k) not in self.eager:
            self.eager[tree.paths, top_k] = TreeDraft(self.fast, tree, top_k)
        return self.eager[tree.paths, top_k]

    def run(self, tree: TreeBuffers, top_k: int, fresh: torch.Tensor, *args) -> torch.Tensor:
        """`TreeDraft`'s call for `tree`, through its graph where there is one for a step of this many rows."""
        if self.compiled is None or fresh.shape[0] != FRESH_ROWS:
            return self.draft(tree, top_k)(fresh, *args)
        key = tree.paths, top_k
        if key not in self.graphs:
            logger.info("Compiling the drafting of a %d-node tree: under a minute once, then cached on disk", tree.size)
            self.graphs[key] = compile_step(TreeDraft(self.compiled, tree, top_k).__call__)
        *scalars, keys, values = args
        mark_cache_dynamic([(keys, values)])  # the window: one graph for every context length
        try:
            tokens = call_graph(self.graphs[key], key in self.ready, fresh, *scalars, keys, values)
        except Exception as err:  # torch.compile's own errors have no common base; eager runs the same function
            logger.warning("Compiling the drafting failed, drafting eagerly from now on: %s", first_line(err))
            self.compiled = None
            return self.draft(tree, top_k)(fresh, *args)
        self.ready.add(key)
        return tokens


_TREE_DRAFTS: "weakref.WeakKeyDictionary[torch.nn.Module, TreeDrafts]" = weakref.WeakKeyDictionary()


def tree_drafts(model: MedusaModel) -> TreeDrafts:
    """The `TreeDrafts` of `model`'s heads on its backbone (made on first use, again for another backbone)."""
    drafts = _TREE_DRAFTS.get(model.heads)
    if drafts is None or drafts.fast.embed is not model.backbone.get_input_embeddings():
        drafts = _TREE_DRAFTS[model.heads] = TreeDrafts(model)
    return drafts


class Eagle3TreeDrafter:
    r"""
    `EagleDrafter` for an EAGLE-3 drafter over a Llama layer on static trees (`fast_eagle3_supports`): the same
    drafts, each step one call of `TreeDraft`, over a static cache of the drafter's own that grows with the
    sequence. Trees grown each step (`DynamicDrafter`) keep `EagleDrafter`.
    """

    per_sequence = True  # its cache follows one sequence

    def __init__(self, model: MedusaModel, tree: TreeBuffers):
        if not fast_eagle3_supports(model.heads):
            raise MedusaError(f"Eagle3TreeDrafter needs an EAGLE-3 drafter over a Llama layer, not "
                              f"`{model.heads.head_type}` heads.")
        if tree.max_depth > model.config.num_heads:
            raise MedusaError(f"The tree is {tree.max_depth} deep but the drafter was trained for "
                              f"{model.config.num_heads}: choose a shallower tree.")
        self.model, self.tree = model, tree
        self.width = model.config.hidden_size * (1 + len(model.heads.feature_layers))  # of the backbone's features
        self.drafts = tree_drafts(model)
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None  # [1, H_kv, S, D] each
        self.committed = 0  # positions whose entries are in the cache

    def pending(self, trees: Iterable[TreeBuffers]) -> list[TreeBuffers]:
        """Which of `trees` a step would compile the drafting of now."""
        if self.drafts.compiled is None:
            return []
        return [tree for tree in trees if (tree.paths, self.tree.top_k) not in self.drafts.graphs]

    def warm_up(self, trees: Iterable[TreeBuffers]) -> None:
        """Compile the drafting of `trees` now, with a step of a new sequence over scratch features."""
        like = self.drafts.fast.embed.weight
        for tree in self.pending(trees):
            self.fill(DecodeState([0] * (FRESH_ROWS + 1), 0, like.new_zeros(self.width),
                                  like.new_zeros(FRESH_ROWS, self.width)), tree)

    def cache_window(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's first `window` slots (`cache`)."""
        keys, values = self.cache(window)
        return keys[:, :, :window], values[:, :, :window]

    def cache(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Its keys and values [1, H_kv, S, D], grown (kept) when they are no longer than `window`; always longer,
        so a graph never meets a window equal to the cache's size."""
        if self.kv is None or self.kv[0].shape[2] <= window:
            layer, like = self.drafts.fast.layer, self.drafts.fast.embed.weight
            grown = tuple(like.new_zeros(1, layer.kv_heads, round_up(2 * window, 256), layer.head_dim)
                          for _ in range(2))
            if self.kv is not None:
                for new, old in zip(grown, self.kv):
                    new[:, :, : old.shape[2]] = old
            self.kv = grown
        return self.kv

    @torch.no_grad()
    def start(self, features: torch.Tensor, after: torch.Tensor) -> None:
        """Start a new sequence with the entries of its first positions, features [n, W] and the token after each
        [n], when its steps then draft elsewhere (a whole step's graph, `static_step.py`)."""
        count = features.shape[0]
        if count:
            keys, values = self.cache_window(round_up(count))
            positions = torch.arange(count, device=features.device)
            seen = torch.arange(keys.shape[2], device=features.device)[None] <= positions[:, None]
            self.drafts.fast.decode(features, after, positions, seen, keys, values, positions)
        self.committed = count

    @torch.no_grad()
    def fill(self, state: DecodeState, tree: TreeBuffers) -> torch.Tensor:
        """Tokens [T] for `tree`'s nodes (as `EagleDrafter.fill`)."""
        fresh = state.fresh_hidden
        if fresh is None or fresh.shape[-1] < self.width:
            raise MedusaError(f"Eagle3TreeDrafter needs the backbone's features ({self.width} values a position) at "
                              f"the newly committed positions: is the backbone tapped at "
                              f"{list(self.model.heads.feature_layers)}?")
        fresh, count = fresh[..., : self.width], fresh.shape[0]
        start = len(state.token_ids) - 1 - count
        if start not in (0, self.committed):
            raise MedusaError(f"Eagle3TreeDrafter is out of step: it has {self.committed} positions, the state "
                              f"starts new ones at {start}.")
        device = fresh.device
        after = torch.tensor(state.token_ids[start + 1 :], device=device)  # the token after each fresh position
        rows = max(count, FRESH_ROWS)
        if rows > count:
            fresh = torch.cat([fresh, fresh.new_zeros(rows - count, self.width)])
            after = torch.cat([after, after.new_zeros(rows - count)])
        draft = self.drafts.draft(tree, self.tree.top_k)
        keys, values = self.cache_window(round_up(start + rows + draft.drafted))
        tokens = self.drafts.run(tree, self.tree.top_k, fresh, after, torch.tensor(start, device=device),
                                 torch.tensor(count, device=device), torch.tensor(state.root, device=device),
                                 keys, values)
        self.committed = start + count
        return tokens

    def propose(self, state: DecodeState) -> Draft:
        return Draft(self.tree, self.fill(state, self.tree))
