r"""
A whole tree step as one compiled graph: the heads' drafting of a static tree, the backbone's forward over it,
greedy acceptance and the KV cache's compaction, for a batch of one, with one read from the device per step.

`decode_step` runs a step as a few hundred host-driven operations between the compiled forward's graph and the
heads (`compiled_llama.py`): drafting, building the tree's mask, picking the accepted path, moving its entries
down the cache, each with its own Python and each a point where the host waits for the device. `StaticStep` is the
same step written as one function of tensors, the state carried from step to step (the root, the hidden state
that predicted it, the cache's length) staying on the device; `torch.compile` turns it into one graph per tree.
The host's part is the n-gram branch (prompt lookup needs the tokens, which it reads once per step anyway) and
the bookkeeping of lengths.

It applies where the backbone decodes through a `CompiledLlama`, the drafter is a `MedusaDrafter` (Medusa or
Hydra heads) alone or with an n-gram branch (`MedusaNgramDrafter`), or a `PlainDrafter` (plain decoding is the
step of a tree of the root alone), acceptance is greedy and one sequence is decoded; everything else takes
`decode_step`, which computes the same tokens. In bf16 on a CPU with AMX, each tree's graph is a package compiled
ahead of time with the weights laid out for inductor's own products (`frozen_step.py`), and an in-process graph
only where that fails.
"""

import logging
import time
import weakref
from typing import Callable

import torch

from medusa_heads.backbone import first_line
from medusa_heads.compiled_llama import CompiledLlama, call_graph, compile_step, mark_cache_dynamic
from medusa_heads.fast_llama import FAST_FORWARD, FastLlama
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers

from .acceptance import GreedyAcceptance
from .cache import TreeCache, round_up
from . import frozen_step
from .draft import Acceptance, DecodeState, Drafter
from .drafters.heads import HeadsDraft, MedusaDrafter
from .drafters.ngram import MedusaNgramDrafter
from .drafters.plain import PlainDrafter

logger = logging.getLogger(__name__)


class StaticStep:
    r"""
    One tree step of a batch of one as a function of tensors, for the static tree `tree` (its nodes `chain_nodes`
    taking the n-gram branch's tokens, if given).

    (root [1], the hidden state that predicted it [H], the chain's tokens [L] or None, the cache's length [1],
    key slots [window] (0, 1, ... : the attention window), per layer (keys, values) [1, H_kv, S, D])
    -> (what the host reads: accepted path [D + 1] (node ids, padded), its tokens [D + 1], accepted length, bonus;
    the next root [1]; its hidden state [H]; the cache's next length [1]).
    The tree's entries are written at slots length, length + 1, ...; the accepted path's entries then move down to
    follow the cache's.
    """

    def __init__(self, model: MedusaModel, fast: FastLlama, tree: TreeBuffers, top_k: int,
                 chain_nodes: torch.Tensor | None, linears: str):
        self.fast, self.tree, self.chain_nodes = fast, tree, chain_nodes
        self.size = tree.size  # dynamo does not trace `TreeBuffers`' properties (`tree/` reads as the `tree` package)
        self.draft = HeadsDraft(model, tree, top_k, linears) if tree.size > 1 else None  # the root alone: plain
        device = tree.depth.device
        self.node_slots = torch.arange(tree.size, device=device)
        self.path_slots = torch.arange(tree.max_depth + 1, device=device)

    def __call__(self, root: torch.Tensor, hidden: torch.Tensor, chain: torch.Tensor | None, length: torch.Tensor,
                 key_slots: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        tree = self.tree
        tokens = root if self.draft is None else self.draft(hidden, root)
        if chain is not None:
            tokens = tokens.index_copy(0, self.chain_nodes, chain)
        # Each node sees the cache's entries and its ancestors: [T, window]
        offset = key_slots - length  # a key slot's place among the tree's nodes (< 0: the cache's entries)
        in_tree = (offset >= 0) & (offset < self.size)
        mask = torch.where(in_tree[None], tree.mask[:, offset.clamp(0, self.size - 1)], (offset < 0)[None])
        hidden_states, _ = self.fast.decode(tokens[None], (length + tree.depth)[None], mask[None, None], kv,
                                            length + self.node_slots)
        logits = self.fast.lm_head(hidden_states)
        paths, accepted, bonus = GreedyAcceptance.accept_rows(tree, tokens[None], logits)
        path = paths[0]
        source, target = length + path, length + self.path_slots  # past the accepted length: copies nobody reads
        for keys, values in kv:
            keys.index_copy_(2, target, keys.index_select(2, source))
            values.index_copy_(2, target, values.index_select(2, source))
        packet = torch.cat([path, tokens[path], accepted, bonus])
        last = hidden_states[0].index_select(0, path.gather(0, accepted))[0]  # that predicted the bonus
        return packet, bonus, last, length + accepted + 1


class StaticSteps:
    """A model's `StaticStep`s, one per tree (with or without the n-gram branch), compiled on first use: one graph
    each, shared by its drafters."""

    def __init__(self, model: MedusaModel, compiled: CompiledLlama):
        self.model, self.compiled = model, compiled
        self.graphs: dict[tuple, Callable] = {}
        self.eager: dict[tuple, StaticStep] = {}
        self.ready: set[tuple] = set()  # the keys of `graphs` that have run
        self.failed = False
        self.frozen = frozen_step.applies(model)  # its graphs are `frozen_step` packages

    def pending(self, drafter: Drafter) -> list[TreeBuffers]:
        """The trees of `drafter` whose step a decode would compile now."""
        top_k = heads_of(drafter).tree.top_k
        return [] if self.failed else [tree for tree, _ in step_trees(drafter) if (tree.paths, top_k) not in self.ready]

    def stored(self, drafter: Drafter) -> bool:
        """Whether every step `pending` lists for `drafter` is a frozen package on disk: loaded, not compiled."""
        top_k = heads_of(drafter).tree.top_k
        pending = {tree.paths for tree in self.pending(drafter)}
        return self.frozen and all(frozen_step.package_path(self.model, tree, top_k, chain_nodes is not None).exists()
                                   for tree, chain_nodes in step_trees(drafter) if tree.paths in pending)

    @torch.no_grad()
    def warm_up(self, drafter: Drafter) -> None:
        """Compile the steps of `drafter`'s trees now, each with a step over scratch buffers."""
        top_k = heads_of(drafter).tree.top_k
        like = self.compiled.eager.embed.weight
        pending = {tree.paths for tree in self.pending(drafter)}
        for tree, chain_nodes in step_trees(drafter):
            if tree.paths not in pending or self.failed:
                continue
            context = 16  # any context: the window and the cache's size are dynamic in the graph
            window = round_up(context + tree.size)
            kv = self.compiled.scratch_cache(window)
            mark_cache_dynamic(kv)
            key_slots = torch.arange(window, device=like.device)
            torch._dynamo.mark_dynamic(key_slots, 0)
            chain = None if chain_nodes is None else chain_nodes.new_zeros(chain_nodes.shape)
            self.run(tree, top_k, chain_nodes, like.new_zeros(1, dtype=torch.long), like.new_zeros(like.shape[1]),
                     chain, torch.tensor([context], device=like.device), key_slots, kv)

    def run(self, tree: TreeBuffers, top_k: int, chain_nodes: torch.Tensor | None, *args):
        key = tree.paths, top_k
        if self.failed:
            if key not in self.eager:
                self.eager[key] = StaticStep(self.model, self.compiled.eager, tree, top_k, chain_nodes, "packed")
            return self.eager[key](*args)
        if key not in self.graphs and self.frozen:
            try:
                plain = lambda: StaticStep(self.model, FastLlama(self.model.backbone, plain=True), tree, top_k,
                                           chain_nodes, "plain")
                self.graphs[key] = frozen_step.load_or_build(self.model, tree, top_k, chain_nodes,
                                                             self.compiled.scratch_cache, plain)
            except Exception as err:  # export's and inductor's errors have no common base
                logger.warning("Compiling the whole step ahead of time failed, compiling it in process instead: %s",
                               first_line(err))
                self.frozen = False
        if key not in self.graphs:
            logger.info("Compiling the whole step of a %d-node tree: under a minute once, then cached on disk",
                        tree.size)
            step = StaticStep(self.model, self.compiled.compilable, tree, top_k, chain_nodes, "opaque")
            self.graphs[key] = compile_step(step.__call__)
        if self.frozen:
            try:
                out = self.graphs[key](*args)
            except Exception as err:  # the package's own checks of its inputs' sizes, say
                logger.warning("The whole step's package failed, compiling the step in process from now on: %s",
                               first_line(err))
                self.frozen, self.graphs, self.ready = False, {}, set()
                return self.run(tree, top_k, chain_nodes, *args)
            self.ready.add(key)
            return out
        try:
            out = call_graph(self.graphs[key], key in self.ready, *args)
        except Exception as err:  # torch.compile's own errors have no common base; eager runs the same function
            logger.warning("Compiling the whole step failed, stepping eagerly from now on: %s", first_line(err))
            self.failed = True
            return self.run(tree, top_k, chain_nodes, *args)
        self.ready.add(key)
        return out


def heads_of(drafter: Drafter) -> Drafter:
    """The drafter whose heads fill the tree (none: a `PlainDrafter`'s root alone): `drafter`, or the one an n-gram
    drafter holds."""
    return drafter.heads if type(drafter) is MedusaNgramDrafter else drafter


_STATIC_STEPS: "weakref.WeakKeyDictionary[torch.nn.Module, StaticSteps]" = weakref.WeakKeyDictionary()


def static_steps(model: MedusaModel, drafter: Drafter, acceptance: Acceptance | None = None) -> StaticSteps | None:
    """The `StaticSteps` that step `drafter` on `model` with `acceptance` (greedy if None), where whole-step graphs
    apply (see the module's docstring); else None."""
    compiled = getattr(model.backbone, FAST_FORWARD, None)
    heads = heads_of(drafter)
    if (not isinstance(compiled, CompiledLlama) or compiled.failed
            or (acceptance is not None and type(acceptance) is not GreedyAcceptance)
            or not (type(heads) is PlainDrafter or type(heads) is MedusaDrafter and heads.model is model)):
        return None
    steps = _STATIC_STEPS.get(model.heads)
    if steps is None or steps.compiled is not compiled:
        steps = _STATIC_STEPS[model.heads] = StaticSteps(model, compiled)
    return steps


def step_trees(drafter: Drafter) -> list[tuple[TreeBuffers, torch.Tensor | None]]:
    """The trees a drafter that `static_steps` takes verifies, each with the nodes of its n-gram branch (None
    without one): its heads' tree, and that tree with the branch where the drafter adds one."""
    if type(drafter) is MedusaNgramDrafter:
        return [(drafter.heads.tree, None), (drafter.tree, drafter.chain_nodes)]
    return [(drafter.tree, None)]


class StaticStepper:
    r"""
    Steps one sequence through `StaticSteps`: the host part of the step (the n-gram branch, the cache's lengths,
    the statistics) around one graph call and one read of its results.
    """

    def __init__(self, steps: StaticSteps, drafter: Drafter, cache: TreeCache, root: int, hidden: torch.Tensor):
        self.steps, self.drafter, self.cache = steps, drafter, cache
        self.heads = heads_of(drafter)
        device = cache.valid.device
        self.root = torch.tensor([root], device=device)
        self.hidden = steps.model.last_hidden(hidden)  # without the layers a tapped backbone adds (`tap_features`)
        self.length = cache.positions.clone()  # a batch of one has no holes: its length is its next position
        self.key_slots = torch.arange(cache.size, device=device)
        self.kv = [(layer.keys, layer.values) for layer in cache.cache.layers]
        mark_cache_dynamic(self.kv)

    def _chain(self, sequence: list[int]) -> torch.Tensor | None:
        if type(self.drafter) is not MedusaNgramDrafter:
            return None
        follow = self.drafter.chain.follow(DecodeState(sequence, sequence[-1], self.hidden))
        if not follow:
            return None
        width = len(self.drafter.chain_nodes)
        return torch.tensor(follow + follow[-1:] * (width - len(follow)), device=self.root.device)

    @torch.no_grad()
    def step(self, sequence: list[int], stats=None) -> tuple[list[int], torch.Tensor]:
        """One step after `sequence` (prompt + committed tokens, the root last) -> (new tokens, the bonus last; the
        hidden state [1, H] that predicted the bonus), recorded in `stats` (a `GenerationStats`, which `generate.py`
        defines and this module cannot import back; the whole step counts as verifying: its drafting is inside the
        graph)."""
        start_time = time.perf_counter()
        chain = self._chain(sequence)
        if chain is None:
            tree, chain_nodes = self.heads.tree, None
        else:
            tree, chain_nodes = self.drafter.tree, self.drafter.chain_nodes
        window = self.cache.reserve(tree.size)
        key_slots = self.key_slots[:window]
        torch._dynamo.mark_dynamic(key_slots, 0)  # one graph for every context length
        packet, self.root, self.hidden, self.length = self.steps.run(
            tree, self.heads.tree.top_k, chain_nodes, self.root, self.hidden, chain, self.length, key_slots, self.kv)
        host = packet.tolist()  # the step's one read
        width = tree.max_depth + 1
        accepted, bonus = host[-2], host[-1]
        start = self.cache.lengths[0]
        self.cache.lengths[0] = start + accepted + 1
        self.cache.valid[0, start : start + accepted + 1] = True
        self.cache.positions = self.length
        if stats is not None:
            stats.record(tree.paths, host[: accepted + 1])
            stats.verify_seconds += time.perf_counter() - start_time
        return host[width + 1 : width + accepted + 1] + [bonus], self.hidden[None]
