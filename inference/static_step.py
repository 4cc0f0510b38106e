r"""
A whole tree step as one compiled graph: the drafting of a static tree, the backbone's forward over it, its
acceptance (greedy, or sampling) and the KV cache's compaction, for a batch of one, with one read from the device per
step.

`decode_step` runs a step as a few hundred host-driven operations between the compiled forward's graph and the
drafter (`compiled_llama.py`): drafting, building the tree's mask, picking the accepted path, moving its entries
down the cache, each with its own Python and each a point where the host waits for the device. `StaticStep` is the
same step written as one function of tensors, the state carried from step to step (the root, the hidden state
that predicted it, or an EAGLE-3 drafter's features of the positions the last step committed; the cache's length)
staying on the device; `torch.compile` turns it into one graph per tree. The host's part is the n-gram branch
(prompt lookup needs the tokens, which it reads once per step anyway) and the bookkeeping of lengths.

It applies where the backbone decodes through a `CompiledLlama` (or, on a GPU, the fast forward), the drafter is a
`MedusaDrafter` (Medusa or Hydra heads) or an `Eagle3TreeDrafter`, alone or with an n-gram branch
(`MedusaNgramDrafter`), or a `PlainDrafter` (plain decoding is the step of a tree of the root alone), acceptance is
greedy, exact or typical (`ExactRule`, `TypicalRule`: their settings and each step's random numbers are inputs, drawn
on the host from the rule's generator as `decode_step` draws them, so a seed gives the same tokens either way) and one
sequence is decoded; everything else takes `decode_step`, which computes the same tokens. In bf16 on
a CPU with AMX, each tree's graph is a package compiled ahead of time with the weights laid out for inductor's own
products (`frozen_step.py`), and an in-process graph only where that fails. On a GPU each tree's step is replayed
as a CUDA graph (`captured_step.py`), over a KV cache the steps lend to one decode after another, so that the
graphs captured once (at warm-up, `generate.capture_steps`) serve every answer.
"""

import logging
import time
import weakref
from typing import Callable

import torch

from medusa_heads.backbone import FEATURE_LAYERS, first_line
from medusa_heads.compiled_llama import CompiledLlama, call_graph, compile_step, mark_cache_dynamic
from medusa_heads.fast_eagle3 import FastEagle3, fast_eagle3_supports
from medusa_heads.fast_llama import FAST_FORWARD, FastLlama
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers

from .acceptance import ExactAcceptance, GreedyAcceptance, StepRule, TypicalAcceptance, sibling_table
from .cache import BUCKET, TreeCache, round_up
from .captured_step import CapturedStep, tensors
from . import frozen_step
from .draft import Acceptance, DecodeState, Drafter
from .drafters.eagle3_tree import FRESH_ROWS, Eagle3TreeDrafter, TreeDraft, tree_drafts
from .drafters.heads import HeadsDraft, MedusaDrafter
from .drafters.ngram import MedusaNgramDrafter
from .drafters.plain import PlainDrafter

logger = logging.getLogger(__name__)

STEP_RULES = (ExactAcceptance, TypicalAcceptance)  # the sampling rules a whole step accepts by, besides greedy
MEMORY = 5  # a step's arguments from here on are memory it reads and writes in place: slots, caches
POOLED_SIZE = 1024  # the smallest cache a GPU's graphs are captured over: most chats' decodes then share one size


class StaticStep:
    r"""
    One tree step of a batch of one as a function of tensors, for the static tree `tree` (its nodes `chain_nodes`
    taking the n-gram branch's tokens, if given), drafted by `draft` (a `HeadsDraft`; None for the root alone),
    accepting by `rule` (an `ExactRule` or a `TypicalRule`; None: greedy).

    (root [1], state: (the hidden state that predicted the root [H],), sampling: the rule's inputs (greedy: (); else
    its acceptance's `step_inputs`), the chain's tokens [L] or None, the cache's length [1], key slots [window] (0, 1,
    ... : the attention window), per layer (keys, values) [1, H_kv, S, D], the drafter's own cache: ())
    -> (what the host reads: accepted path [D + 1] (node ids, padded), its tokens [D + 1], accepted length, bonus;
    the next root [1]; the next state; the cache's next length [1]).
    The tree's entries are written at slots length, length + 1, ...; the accepted path's entries then move down to
    follow the cache's.
    """

    def __init__(self, fast: FastLlama, tree: TreeBuffers, chain_nodes: torch.Tensor | None,
                 draft: Callable | None, taps: tuple[int, ...] = (), rule: StepRule | None = None):
        self.fast, self.tree, self.chain_nodes, self.draft, self.taps = fast, tree, chain_nodes, draft, taps
        self.size = tree.size  # dynamo does not trace `TreeBuffers`' properties (`tree/` reads as the `tree` package)
        device = tree.depth.device
        self.rule = rule
        self.earlier = sibling_table(tree.paths, str(device)) if rule else None
        self.node_slots = torch.arange(tree.size, device=device)
        self.path_slots = torch.arange(tree.max_depth + 1, device=device)

    def __call__(self, root: torch.Tensor, state: tuple, sampling: tuple, chain: torch.Tensor | None,
                 length: torch.Tensor, key_slots: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                 own_cache: tuple):
        hidden, = state
        tokens = root if self.draft is None else self.draft(hidden, root)
        packet, bonus, path, accepted, hidden_states = self.verify(tokens, sampling, chain, length, key_slots, kv)
        last = hidden_states.index_select(0, path.gather(0, accepted))[0]  # that predicted the bonus
        return packet, bonus, (last,), length + accepted + 1

    def verify(self, tokens: torch.Tensor, sampling: tuple, chain: torch.Tensor | None, length: torch.Tensor,
               key_slots: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        """The tree's tokens [T] (the n-gram branch's nodes replaced by `chain`) through the backbone, accepted and
        compacted -> (the host's packet, bonus [1], accepted path [D + 1], accepted length [1], the backbone's
        hidden states [T, H'], the layers `taps` after the last)."""
        tree = self.tree
        if chain is not None:
            tokens = tokens.index_copy(0, self.chain_nodes, chain)
        # Each node sees the cache's entries and its ancestors: [T, window]
        offset = key_slots - length  # a key slot's place among the tree's nodes (< 0: the cache's entries)
        in_tree = (offset >= 0) & (offset < self.size)
        mask = torch.where(in_tree[None], tree.mask[:, offset.clamp(0, self.size - 1)], (offset < 0)[None])
        last, hidden_states = self.fast.decode(tokens[None], (length + tree.depth)[None], mask[None, None], kv,
                                               length + self.node_slots, self.taps)
        logits = self.fast.lm_head(last)
        if self.rule is None:
            paths, accepted, bonus = GreedyAcceptance.accept_rows(tree, tokens[None], logits)
            path = paths[0]
        else:
            path, accepted, bonus = self.rule(tree, self.earlier, tokens, logits[0], *sampling)
        source, target = length + path, length + self.path_slots  # past the accepted length: copies nobody reads
        for keys, values in kv:
            keys.index_copy_(2, target, keys.index_select(2, source))
            values.index_copy_(2, target, values.index_select(2, source))
        packet = torch.cat([path, tokens[path], accepted, bonus])
        return packet, bonus, path, accepted, hidden_states[0]


class Eagle3StaticStep(StaticStep):
    r"""
    `StaticStep` drafted by an EAGLE-3 drafter (`TreeDraft`), whose state is the backbone's features at the
    positions the last step committed rather than one hidden state, and which has a cache of its own.

    state: (features [F, W] at the newly committed positions (the first `count` rows real, F = `FRESH_ROWS`), the
    token after each [F], count [1], the positions the drafter's cache holds [1]); own_cache: (its key slots
    [window'], its keys and values [1, H_kv, S', D]).
    """

    def __call__(self, root: torch.Tensor, state: tuple, sampling: tuple, chain: torch.Tensor | None,
                 length: torch.Tensor, key_slots: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                 own_cache: tuple):
        fresh, after, count, committed = state
        draft_slots, draft_keys, draft_values = own_cache
        window = draft_slots.shape[0]
        tokens = self.draft(fresh, after, committed, count, root, draft_keys[:, :, :window],
                            draft_values[:, :, :window])
        packet, bonus, path, accepted, features = self.verify(tokens, sampling, chain, length, key_slots, kv)
        rows = torch.arange(fresh.shape[0], device=fresh.device)
        deepest = path.shape[0] - 1
        on_path = path.index_select(0, rows.clamp(max=deepest))  # padded: rows past the accepted length are unread
        following = tokens.index_select(0, path.index_select(0, (rows + 1).clamp(max=deepest)))
        next_after = torch.where(rows == accepted, bonus, following)
        next_fresh = features.index_select(0, on_path)[:, : fresh.shape[1]]
        return packet, bonus, (next_fresh, next_after, accepted + 1, committed + count), length + accepted + 1


class StaticSteps:
    """A model's `StaticStep`s, one per tree (with or without the n-gram branch), compiled on first use: one graph
    each, shared by its drafters."""

    def __init__(self, model: MedusaModel, forward: CompiledLlama | FastLlama):
        self.model = model
        self.compiled = forward if isinstance(forward, CompiledLlama) else None  # None: steps run eagerly
        self.fast = forward.eager if self.compiled else forward
        self.capture = self.fast.embed.weight.device.type == "cuda"  # a decode's steps replay CUDA graphs
        self.eagle3 = tree_drafts(model) if fast_eagle3_supports(model.heads) else None  # its drafting, if EAGLE-3
        self.taps = getattr(model.backbone, FEATURE_LAYERS, ()) if self.eagle3 else ()
        self.graphs: dict[tuple, Callable] = {}
        self.eager: dict[tuple, StaticStep] = {}
        # On a GPU: each tree's CUDA graphs, one per memory it was captured over (`replay`); that memory, which
        # outlives decodes: the caches free for the next decode, the EAGLE-3 drafter's cache that goes with each
        self.captured: dict[tuple, CapturedStep] = {}
        self.graph_pool = None  # one memory pool for all the graphs
        self.free_caches: dict[int, list[TreeCache]] = {}
        self.own_caches: "weakref.WeakKeyDictionary[TreeCache, tuple]" = weakref.WeakKeyDictionary()
        self._slots: dict[int, torch.Tensor] = {}
        self.ready: set[tuple] = set()  # the keys of `graphs` that have run
        self.failed = False
        self.frozen = frozen_step.applies(model)  # its graphs are `frozen_step` packages

    def borrow_cache(self, max_len: int) -> TreeCache:
        """A cache for one decode of a batch of one, up to `max_len` entries (`give_back` it after). On a GPU one
        the steps' graphs were captured over, if free: its size is a power of two (at least `POOLED_SIZE`), so that
        decodes of similar lengths replay the same graphs rather than capture their own."""
        backbone = self.model.backbone
        if not self.capture:
            return TreeCache(backbone, 1, max_len)
        size = max(POOLED_SIZE, 1 << (TreeCache.size_for(max_len) - 1).bit_length())
        free = self.free_caches.setdefault(size, [])
        cache = free.pop() if free else TreeCache(backbone, 1, size - BUCKET)
        cache.rewind(0)
        return cache

    def give_back(self, cache: TreeCache) -> None:
        """`cache`, which a decode no longer uses, to the next decode of its size."""
        if self.capture:
            self.free_caches.setdefault(cache.size, []).append(cache)

    def slots(self, n: int) -> torch.Tensor:
        """0, 1, ..., n - 1 on the device, one tensor for every decode (on a GPU, memory a graph reads)."""
        if n not in self._slots:
            self._slots[n] = torch.arange(n, device=self.fast.embed.weight.device)
        return self._slots[n]

    def replay(self, tree: TreeBuffers, top_k: int, chain_nodes: torch.Tensor | None, rule: StepRule | None,
               args: tuple) -> tuple:
        """The step of `tree` on `args` as a CUDA graph (`captured_step.py`), captured on first use over the memory
        `args` name (the slots, the caches) and replayed while they stay the same: for the next decodes too, since
        their caches come from `borrow_cache`."""
        key = tree.paths, top_k, rule, tuple((tensor.data_ptr(), tensor.shape) for tensor in tensors(args[MEMORY:]))
        if key not in self.captured:
            logger.info("Capturing the whole step of a %d-node tree as a CUDA graph", tree.size)
            graph = CapturedStep(lambda *step_args: self.run(tree, top_k, chain_nodes, rule, *step_args), args,
                                 self.graph_pool)
            self.graph_pool, self.captured[key] = graph.pool, graph
        return self.captured[key](*args)

    def pending(self, drafter: Drafter, rule: StepRule | None = None) -> list[TreeBuffers]:
        """The trees of `drafter` whose step accepting by `rule` a decode would compile now (on a GPU: capture)."""
        top_k = heads_of(drafter).tree.top_k
        if self.capture:
            return [tree for tree, _ in step_trees(drafter) if not any(key[:3] == (tree.paths, top_k, rule)
                                                                       for key in self.captured)]
        if self.failed or self.compiled is None:
            return []
        return [tree for tree, _ in step_trees(drafter) if (tree.paths, top_k, rule) not in self.ready]

    def stored(self, drafter: Drafter, rule: StepRule | None = None) -> bool:
        """Whether every step `pending` lists for `drafter` is a frozen package on disk: loaded, not compiled."""
        top_k = heads_of(drafter).tree.top_k
        pending = {tree.paths for tree in self.pending(drafter, rule)}
        return self.frozen and all(
            frozen_step.package_path(self.model, tree, top_k, chain_nodes is not None, rule).exists()
            for tree, chain_nodes in step_trees(drafter) if tree.paths in pending)

    def step(self, tree: TreeBuffers, top_k: int, chain_nodes: torch.Tensor | None, rule: StepRule | None,
             twin: str) -> StaticStep:
        """The step of `tree`, accepting by `rule`, over the weights as `twin` says: "eager" (as the model holds them),
        "opaque" (through the operators an in-process graph can hold) or "plain" (for a graph that lays them out
        itself)."""
        fast = {"eager": lambda: self.fast, "opaque": lambda: self.compiled.compilable,
                "plain": lambda: FastLlama(self.model.backbone, plain=True)}[twin]()
        if tree.size == 1:  # the root alone: plain decoding
            return StaticStep(fast, tree, chain_nodes, None, rule=rule)
        if self.eagle3 is None:
            linears = "packed" if twin == "eager" else twin
            return StaticStep(fast, tree, chain_nodes, HeadsDraft(self.model, tree, top_k, linears), rule=rule)
        drafting = {"eager": lambda: self.eagle3.fast, "opaque": lambda: self.eagle3.compiled,
                    "plain": lambda: FastEagle3(self.model.heads, self.model.backbone.get_input_embeddings(),
                                                plain=True)}[twin]()
        return Eagle3StaticStep(fast, tree, chain_nodes, TreeDraft(drafting, tree, top_k), self.taps, rule)

    def scratch_args(self, tree: TreeBuffers, top_k: int, chain_nodes: torch.Tensor | None, rule: StepRule | None
                     ) -> tuple:
        """The arguments of a step of `tree` over scratch buffers, their sizes marked dynamic: what warm-up and
        `frozen_step` step."""
        like = self.compiled.eager.embed.weight
        context = frozen_step.CONTEXT  # any context: the window and the cache's size are dynamic in the graph
        window = round_up(context + tree.size)
        kv = self.compiled.scratch_cache(window)
        mark_cache_dynamic(kv)
        key_slots = torch.arange(window, device=like.device)
        torch._dynamo.mark_dynamic(key_slots, 0)
        chain = None if chain_nodes is None else chain_nodes.new_zeros(chain_nodes.shape)
        root, length = like.new_zeros(1, dtype=torch.long), torch.tensor([context], device=like.device)
        sampling = () if rule is None else rule.scratch_inputs(tree.size, like.device)
        if tree.size == 1 or self.eagle3 is None:
            return root, (like.new_zeros(like.shape[1]),), sampling, chain, length, key_slots, kv, ()
        layer, drafted = self.eagle3.fast.layer, self.eagle3.draft(tree, top_k).drafted
        draft_window = round_up(context + FRESH_ROWS + drafted)
        draft_kv = [like.new_zeros(1, layer.kv_heads, 2 * draft_window, layer.head_dim) for _ in range(2)]
        mark_cache_dynamic([draft_kv])
        draft_slots = torch.arange(draft_window, device=like.device)
        torch._dynamo.mark_dynamic(draft_slots, 0)
        width = like.shape[1] * (1 + len(self.taps))
        state = (like.new_zeros(FRESH_ROWS, width), like.new_zeros(FRESH_ROWS, dtype=torch.long),
                 torch.tensor([1], device=like.device), length.clone())
        return root, state, sampling, chain, length, key_slots, kv, (draft_slots, *draft_kv)

    @torch.no_grad()
    def warm_up(self, drafter: Drafter, rule: StepRule | None = None) -> None:
        """Compile the steps of `drafter`'s trees accepting by `rule` now, each with a step over scratch buffers."""
        top_k = heads_of(drafter).tree.top_k
        pending = {tree.paths for tree in self.pending(drafter, rule)}
        for tree, chain_nodes in step_trees(drafter):
            if tree.paths in pending and not self.failed:
                self.run(tree, top_k, chain_nodes, rule, *self.scratch_args(tree, top_k, chain_nodes, rule))

    def run(self, tree: TreeBuffers, top_k: int, chain_nodes: torch.Tensor | None, rule: StepRule | None, *args):
        key = tree.paths, top_k, rule
        if self.failed or self.compiled is None:
            if key not in self.eager:
                self.eager[key] = self.step(tree, top_k, chain_nodes, rule, "eager")
            return self.eager[key](*args)
        if key not in self.graphs and self.frozen:
            try:
                self.graphs[key] = frozen_step.load_or_build(
                    self.model, tree, top_k, chain_nodes is not None, rule,
                    lambda: (self.step(tree, top_k, chain_nodes, rule, "plain"),
                             self.scratch_args(tree, top_k, chain_nodes, rule)))
            except Exception as err:  # export's and inductor's errors have no common base
                logger.warning("Compiling the whole step ahead of time failed, compiling it in process instead: %s",
                               first_line(err))
                self.frozen = False
        if key not in self.graphs:
            logger.info("Compiling the whole step of a %d-node tree: under a minute once, then cached on disk",
                        tree.size)
            self.graphs[key] = compile_step(self.step(tree, top_k, chain_nodes, rule, "opaque").__call__)
        if self.frozen:
            try:
                out = self.graphs[key](*args)
            except Exception as err:  # the package's own checks of its inputs' sizes, say
                logger.warning("The whole step's package failed, compiling the step in process from now on: %s",
                               first_line(err))
                self.frozen, self.graphs, self.ready = False, {}, set()
                return self.run(tree, top_k, chain_nodes, rule, *args)
            self.ready.add(key)
            return out
        try:
            out = call_graph(self.graphs[key], key in self.ready, *args)
        except Exception as err:  # torch.compile's own errors have no common base; eager runs the same function
            logger.warning("Compiling the whole step failed, stepping eagerly from now on: %s", first_line(err))
            self.failed = True
            return self.run(tree, top_k, chain_nodes, rule, *args)
        self.ready.add(key)
        return out


def heads_of(drafter: Drafter) -> Drafter:
    """The drafter whose heads fill the tree (none: a `PlainDrafter`'s root alone): `drafter`, or the one an n-gram
    drafter holds."""
    return drafter.heads if type(drafter) is MedusaNgramDrafter else drafter


_STATIC_STEPS: "weakref.WeakKeyDictionary[torch.nn.Module, StaticSteps]" = weakref.WeakKeyDictionary()


def static_steps(model: MedusaModel, drafter: Drafter, acceptance: Acceptance | None = None) -> StaticSteps | None:
    """The `StaticSteps` that step `drafter` on `model` with `acceptance` (greedy if None, exact or typical), where
    whole-step graphs apply (see the module's docstring); else None."""
    forward = getattr(model.backbone, FAST_FORWARD, None)
    compiled = isinstance(forward, CompiledLlama) and not forward.failed
    on_gpu = type(forward) is FastLlama and forward.embed.weight.device.type == "cuda"
    heads = heads_of(drafter)
    if (not (compiled or on_gpu) or type(acceptance) not in (type(None), GreedyAcceptance, *STEP_RULES)
            or not (type(heads) is PlainDrafter or type(heads) in (MedusaDrafter, Eagle3TreeDrafter)
                    and heads.model is model)):
        return None
    if type(heads) is Eagle3TreeDrafter and (compiled and tree_drafts(model).compiled is None
                                              or heads.tree.max_depth + 1 > FRESH_ROWS):
        return None  # its drafting does not compile, or a step commits more positions than a graph's drafting takes
    steps = _STATIC_STEPS.get(model.heads)
    if steps is None or forward not in (steps.compiled, steps.fast):
        steps = _STATIC_STEPS[model.heads] = StaticSteps(model, forward)
    return steps


def step_rule(acceptance: Acceptance | None) -> StepRule | None:
    """The rule a whole step accepts by for `acceptance` (one `static_steps` takes): None for greedy."""
    return acceptance.rule if type(acceptance) in STEP_RULES else None


def step_trees(drafter: Drafter) -> list[tuple[TreeBuffers, torch.Tensor | None]]:
    """The trees a drafter that `static_steps` takes verifies, each with the nodes of its n-gram branch (None
    without one): its heads' tree, and that tree with the branch where the drafter adds one."""
    if type(drafter) is MedusaNgramDrafter:
        return [(drafter.heads.tree, None), (drafter.tree, drafter.chain_nodes)]
    return [(drafter.tree, None)]


class StaticStepper:
    r"""
    Steps one sequence through `StaticSteps`: the host part of the step (the n-gram branch, the cache's lengths,
    the statistics, a sampling rule's random numbers) around one graph call and one read of its results. `hidden`:
    the backbone's hidden states [n, H'] at the prompt's positions; `acceptance`: greedy (None), exact or typical.
    """

    def __init__(self, steps: StaticSteps, drafter: Drafter, cache: TreeCache, root: int, hidden: torch.Tensor,
                 prompt: list[int], acceptance: Acceptance | None = None):
        self.steps, self.drafter, self.cache = steps, drafter, cache
        self.acceptance, self.rule = acceptance, step_rule(acceptance)
        self.heads = heads_of(drafter)
        device = cache.valid.device
        self.root = torch.tensor([root], device=device)
        self.length = cache.positions.clone()  # a batch of one has no holes: its length is its next position
        self.key_slots = steps.slots(cache.size)
        self.kv = [(layer.keys, layer.values) for layer in cache.cache.layers]
        mark_cache_dynamic(self.kv)
        self.eagle3 = type(self.heads) is Eagle3TreeDrafter
        if self.eagle3:
            self._start_drafting(hidden, prompt + [root])
        else:  # the last hidden state, without the layers a tapped backbone adds (`tap_features`)
            self.state = (steps.model.last_hidden(hidden[-1]),)

    def _start_drafting(self, features: torch.Tensor, sequence: list[int]) -> None:
        """The EAGLE-3 drafter's cache takes the prompt's positions but the last `FRESH_ROWS`, which the first step's
        graph appends (as every step appends the positions the last one committed)."""
        width, device = self.heads.width, features.device
        # past any window its steps read: the drafter's entries are the committed positions', then a tree's
        self.draft_slots = self.steps.slots(self.cache.size + BUCKET)
        if self.steps.capture:  # the drafter's cache that goes with this decode's: the memory of the same graphs
            self.heads.kv = self.steps.own_caches.get(self.cache)
            self.heads.cache(self.draft_slots.shape[0])
            self.steps.own_caches[self.cache] = self.heads.kv
        features = features[..., :width]
        count = min(features.shape[0], FRESH_ROWS)
        self.committed = features.shape[0] - count  # positions in the drafter's cache
        self.heads.start(features[: self.committed], torch.tensor(sequence[1 : self.committed + 1], device=device))
        fresh = torch.cat([features[self.committed :], features.new_zeros(FRESH_ROWS - count, width)])
        after = torch.tensor(sequence[self.committed + 1 :] + [0] * (FRESH_ROWS - count), device=device)
        self.state = (fresh, after, torch.tensor([count], device=device),
                      torch.tensor([self.committed], device=device))
        self.fresh_count = count

    def _chain(self, sequence: list[int]) -> torch.Tensor | None:
        if type(self.drafter) is not MedusaNgramDrafter:
            return None
        follow = self.drafter.chain.follow(DecodeState(sequence, sequence[-1], self.state[0]))  # reads the tokens
        if not follow:
            return None
        width = len(self.drafter.chain_nodes)
        return torch.tensor(follow + follow[-1:] * (width - len(follow)), device=self.root.device)

    def _own_cache(self, tree: TreeBuffers) -> tuple:
        """The drafter's cache, as a step of `tree` takes it: its key slots (the window the step reads), its keys and
        values."""
        if not self.eagle3:
            return ()
        drafted = self.steps.eagle3.draft(tree, self.heads.tree.top_k).drafted
        window = round_up(self.committed + FRESH_ROWS + drafted)
        if self.steps.capture:  # one window for every step: a graph's shapes are fixed
            window = self.draft_slots.shape[0]
        keys, values = self.heads.cache(window)
        slots = self.draft_slots[:window]
        torch._dynamo.mark_dynamic(slots, 0)
        mark_cache_dynamic([(keys, values)])
        return slots, keys, values

    def _run(self, tree: TreeBuffers, chain_nodes: torch.Tensor | None, args: tuple) -> tuple:
        """The step of `tree` on `args`: through `StaticSteps`, on a GPU as its CUDA graph."""
        top_k = self.heads.tree.top_k
        if self.steps.capture:
            return self.steps.replay(tree, top_k, chain_nodes, self.rule, args)
        return self.steps.run(tree, top_k, chain_nodes, self.rule, *args)

    @torch.no_grad()
    def step(self, sequence: list[int], stats=None) -> tuple[list[int], torch.Tensor]:
        """One step after `sequence` (prompt + committed tokens, the root last) -> (new tokens, the bonus last; the
        backbone's hidden states [n, H'] at the positions the step committed, the one that predicted the bonus
        last), recorded in `stats` (a `GenerationStats`, which `generate.py` defines and this module cannot import
        back; the whole step counts as verifying: its drafting is inside the graph)."""
        start_time = time.perf_counter()
        chain = self._chain(sequence)
        if chain is None:
            tree, chain_nodes = self.heads.tree, None
        else:
            tree, chain_nodes = self.drafter.tree, self.drafter.chain_nodes
        tokens, hidden = self.step_tree(tree, chain_nodes, chain, stats)
        if stats is not None:
            stats.verify_seconds += time.perf_counter() - start_time
        return tokens, hidden

    def step_tree(self, tree: TreeBuffers, chain_nodes: torch.Tensor | None, chain: torch.Tensor | None,
                  stats=None) -> tuple[list[int], torch.Tensor]:
        """`step`, verifying `tree` (one of `step_trees(drafter)`) with the n-gram branch's tokens `chain` at its
        nodes `chain_nodes`."""
        window = self.cache.reserve(tree.size)
        key_slots = self.key_slots if self.steps.capture else self.key_slots[:window]  # a graph reads every slot
        torch._dynamo.mark_dynamic(key_slots, 0)  # one graph for every context length
        sampling = () if self.rule is None else self.acceptance.step_inputs(tree.size, self.root.device)
        packet, self.root, self.state, self.length = self._run(tree, chain_nodes, (
            self.root, self.state, sampling, chain, self.length, key_slots, self.kv, self._own_cache(tree)))
        host = read(packet)  # the step's one read
        width = tree.max_depth + 1
        accepted, bonus = host[-2], host[-1]
        start = self.cache.lengths[0]
        self.cache.lengths[0] = start + accepted + 1
        self.cache.valid[0, start : start + accepted + 1] = True
        self.cache.positions = self.length
        if self.eagle3:
            self.committed += self.fresh_count
            self.heads.committed, self.fresh_count = self.committed, accepted + 1
        if stats is not None:
            stats.record(tree.paths, host[: accepted + 1])
        hidden = self.state[0][: accepted + 1] if self.eagle3 else self.state[0][None]
        return host[width + 1 : width + accepted + 1] + [bonus], hidden


def read(packet: torch.Tensor) -> list[int]:
    """A step's one read from the device: the one synchronizing call of a step on a GPU, also where a sync debug mode
    (`torch.cuda.set_sync_debug_mode`) forbids any other."""
    if not packet.is_cuda:
        return packet.tolist()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return packet.tolist()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
