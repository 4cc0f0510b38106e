"""The decoding loop: prefill, then tree steps (propose -> verify in one forward -> accept -> compact)."""

import copy
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from medusa_heads.backbone import FEATURE_LAYERS, backbone_forward
from medusa_heads.compiled_llama import CompiledLlama
from medusa_heads.errors import MedusaError
from medusa_heads.fast_llama import FAST_FORWARD
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers, canonical_tree

from .acceptance import GreedyAcceptance, RuleAcceptance
from .cache import TreeCache
from .draft import Acceptance, Accepted, DecodeState, Draft, Drafter
from .static_step import StaticStepper, StaticSteps, static_steps, step_rule, step_trees
from .text import StopStrings, TextStream

SCRATCH_PROMPT = 16  # tokens of the prompt a GPU's graphs are captured after (`capture_steps`)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per tree step, bonus included
    depth_accepts: list[int] = field(default_factory=list)  # [D] steps whose accepted path reached depth d + 1
    # [D][r] steps whose accepted node at depth d + 1 had rank r among its parent's children (its head's top-k
    # rank for a static tree; its place among the parent's guesses for a dynamic one)
    rank_accepts: list[list[int]] = field(default_factory=list)
    first_rejections: list[int] = field(default_factory=list)  # [D] steps whose first rejection was at depth d + 1
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # Of decode_seconds: proposing the drafts, and verifying them (the backbone's forward and the acceptance rule,
    # up to the accepted tokens on the host); the rest is compacting the cache and the loop. Host clock times: on
    # a GPU, work a phase queued is counted where a later phase waits for it. In a batch, each row counts its own
    # proposal and the shared forward whole. A step run as one graph (`static_step.py`) counts whole as verifying.
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per tree forward (accepted drafts + the bonus token)."""
        return sum(self.accepted_lengths) / max(self.steps, 1)

    @property
    def head_acceptance(self) -> list[float]:
        """Per head: share of steps whose accepted path reached that head's depth."""
        return [n / max(self.steps, 1) for n in self.depth_accepts]

    @property
    def accepted_length_counts(self) -> list[int]:
        """Histogram: [n - 1] steps that committed n tokens, for n = 1..D + 1."""
        counts = [0] * (len(self.depth_accepts) + 1)
        for n in self.accepted_lengths:
            counts[n - 1] += 1
        return counts

    @property
    def depth_acceptance(self) -> list[float | None]:
        """Per depth: P(a node is accepted | its parent was and had children drafted); None if never tried."""
        return [a / (a + r) if a + r else None for a, r in zip(self.depth_accepts, self.first_rejections)]

    @property
    def rank_acceptance(self) -> list[list[float]]:
        """[D][r]: share of steps whose accepted node at depth d + 1 had rank r."""
        return [[n / max(self.steps, 1) for n in row] for row in self.rank_accepts]

    @property
    def steps_without_rejection(self) -> int:
        """Steps whose accepted path ended at a leaf: every drafted token on it was accepted."""
        return self.steps - sum(self.first_rejections)

    def init_depths(self, max_depth: int) -> None:
        """Zero the per-depth counters for trees up to `max_depth` deep."""
        self.depth_accepts = [0] * max_depth
        self.rank_accepts = [[] for _ in range(max_depth)]
        self.first_rejections = [0] * max_depth

    def record(self, paths: tuple, nodes: list[int]) -> None:
        """One step: the accepted `nodes` (root first) of the tree `paths` that was drafted."""
        ranks, parents = _ranks_and_parents(paths)
        self.accepted_lengths.append(len(nodes))
        for d, node in enumerate(nodes[1:]):
            self.depth_accepts[d] += 1
            row = self.rank_accepts[d]
            rank = ranks[node]
            row.extend([0] * (rank + 1 - len(row)))
            row[rank] += 1
        if nodes[-1] in parents:  # its children were drafted and all rejected
            self.first_rejections[len(nodes) - 1] += 1

    @property
    def step_ms(self) -> dict[str, float] | None:
        """Where a decoding step's time goes, in ms per step: `draft`, `verify` and `other`; None before a step."""
        if not self.steps:
            return None
        other = self.decode_seconds - self.draft_seconds - self.verify_seconds
        return {phase: 1000 * seconds / self.steps
                for phase, seconds in (("draft", self.draft_seconds), ("verify", self.verify_seconds),
                                       ("other", max(other, 0.0)))}

    @property
    def tokens_per_second(self) -> float:
        total = self.prefill_seconds + self.decode_seconds
        return self.new_tokens / total if total > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_lengths": self.accepted_lengths,
            "head_acceptance": self.head_acceptance,
            "accepted_length_counts": self.accepted_length_counts,
            "depth_accepts": self.depth_accepts,
            "depth_acceptance": self.depth_acceptance,
            "rank_accepts": self.rank_accepts,
            "rank_acceptance": self.rank_acceptance,
            "first_rejections": self.first_rejections,
            "steps_without_rejection": self.steps_without_rejection,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "step_ms": self.step_ms,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class Request:
    """One sequence to decode: its prompt, how it is drafted and accepted, and when it stops."""

    input_ids: list[int]
    drafter: Drafter  # a drafter that keeps state per sequence (`per_sequence`) serves one request only
    acceptance: Acceptance = field(default_factory=GreedyAcceptance)
    max_new_tokens: int = 128
    stop: Callable[[list[int]], int | None] | None = None  # see `generate_ids`
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class _Row:
    """A request being decoded."""

    index: int  # in the list of requests
    request: Request
    sequence: list[int]  # prompt + committed tokens, the root last
    new_ids: list[int]
    hidden: torch.Tensor  # [n, H] the hidden states of the positions committed last


@torch.no_grad()
def prefill(model: MedusaModel, prompts: list[list[int]], cache: TreeCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (left-padded into one batch) -> (logits [B, V] at each last prompt position, hidden states
    [B, L, H] at every padded position)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    positions, mask = cache.prefill_inputs([len(p) for p in prompts], width)
    logits, hidden = backbone_forward(model.backbone, ids, cache.cache, positions, mask, logits_to_keep=1,
                                      prompt=True)
    return logits[:, -1], hidden


@torch.no_grad()
def verify(model: MedusaModel, tree: TreeBuffers, tokens: torch.Tensor, cache: TreeCache,
           internal_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One backbone forward over every row's tree, tokens [B, T] -> (logits [B, T, V], hidden [B, T, H]);
    `internal_only`: the logits of `tree.internal` alone, [B, I, V]."""
    positions, mask = cache.tree_inputs(tree)
    keep = tree.internal if internal_only else 0
    return backbone_forward(model.backbone, tokens, cache.cache, positions, mask, logits_to_keep=keep)


# Greedy verification skips the LM head at the leaves (their argmax is needed only when the accepted path ends at
# one: one more row then) from this many leaves on. The LM head is a fifth of SmolLM2-135M's weights; on this
# project's CPU a row through it costs about 0.2 ms in a tree forward and 1.8 ms alone (its weights read again).
LEAVES_TO_SKIP = 4


def _leaf_bonus(model: MedusaModel, hidden: torch.Tensor) -> list[int]:
    """The backbone's greedy token after each of the nodes whose last hidden states are `hidden` [n, H']."""
    logits = model.backbone.get_output_embeddings()(model.last_hidden(hidden))
    return logits.max(dim=-1).indices.tolist()


@lru_cache(maxsize=256)
def _union(trees: tuple[tuple, ...]) -> tuple:
    """The paths of the smallest tree holding each of `trees` (tuples of paths), in canonical order."""
    return tuple(sorted({p for paths in trees for p in paths}, key=lambda p: (len(p), p)))


@lru_cache(maxsize=1024)
def _node_index(paths: tuple, within: tuple) -> list[int]:
    """Where each node of the tree `paths` sits in the tree `within`, which holds it."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(within)}
    return [0] + [index[p] for p in paths]


def _merge(drafts: list[Draft]) -> tuple[TreeBuffers, torch.Tensor]:
    """One tree for the rows of a batch, the union of their drafts' trees, and each row's tokens in it [B, T]:
    nodes a row did not draft repeat its root (a guess like any other: acceptance stays exact)."""
    paths = _union(tuple(draft.tree.paths for draft in drafts))
    tree = canonical_tree(paths, drafts[0].tokens.device)
    tokens = torch.stack([draft.tokens[:1].repeat(tree.size) for draft in drafts])
    for row, draft in zip(tokens, drafts):
        row[_node_index(draft.tree.paths, paths)] = draft.tokens
    return tree, tokens


@lru_cache(maxsize=256)
def _ranks_and_parents(paths: tuple) -> tuple[list[int], set[int]]:
    """Host-side view of a tree: the rank of each node and the nodes that have children."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    return [0] + [p[-1] for p in paths], {index[p[:-1]] for p in paths}


def step_sizes(drafter: Drafter) -> set[int]:
    """The tree sizes `drafter`'s steps verify: its tree, and its heads' own tree where an n-gram branch is added
    only when it matches (trees grown each step have other sizes too)."""
    heads = getattr(drafter, "heads", None)
    return {drafter.tree.size} | ({heads.tree.size} if hasattr(heads, "tree") else set())


def warm_up(model: MedusaModel, drafter: Drafter, say: Callable[[str], None] = lambda _: None,
            acceptance: Acceptance | None = None) -> None:
    """Compile what decoding one sequence with `drafter` and `acceptance` (greedy if None) will run compiled, if
    the backbone decodes through a compiled step (`compiled_llama.py`): its whole steps (`static_step.py`), else
    the backbone's step for the sizes `drafter` verifies and the drafting of its trees where it compiles that
    (`Eagle3TreeDrafter`); on a GPU, capture its whole steps' CUDA graphs; saying so through `say` first."""
    whole = static_steps(model, drafter, acceptance)
    rule = step_rule(acceptance)
    if whole is not None and whole.capture:
        if trees := whole.pending(drafter, rule):
            say(f"capturing the whole decoding step of {len(trees)} tree{'s' * (len(trees) > 1)} as CUDA graphs")
            capture_steps(model, whole, drafter, acceptance)
        return
    step = getattr(model.backbone, FAST_FORWARD, None)
    if not isinstance(step, CompiledLlama):
        return
    if whole is not None:
        if trees := whole.pending(drafter, rule):
            steps = f"the whole decoding step of {len(trees)} tree{'s' * (len(trees) > 1)}"
            if whole.stored(drafter, rule):
                say(f"loading {steps}, compiled ahead of time, from the disk cache")
            else:
                how = (" ahead of time, the weights laid out for this CPU: about 90 s a tree the first time"
                       if whole.frozen else ": about 40 s a graph the first time")
                say(f"compiling {steps}{how}, then seconds from the disk cache")
            whole.warm_up(drafter, rule)
        return
    taps = getattr(model.backbone, FEATURE_LAYERS, ())
    sizes = step.pending(step_sizes(drafter), taps)
    heads = getattr(drafter, "heads", drafter)  # a drafter that compiles its own steps, or holds one that does
    trees = heads.pending({drafter.tree.paths: drafter.tree, heads.tree.paths: heads.tree}.values()) \
        if hasattr(heads, "pending") else []
    what = ([f"the decoding step for {', '.join(map(str, sizes))}-token steps"] if sizes else []) + \
        ([f"the drafting of {len(trees)} tree{'s' * (len(trees) > 1)}"] if trees else [])
    if what:
        say(f"compiling {' and '.join(what)}: about 40 s a graph the first time, then seconds from the disk cache")
        step.warm_up(sizes, taps)
        if trees:
            heads.warm_up(trees)


@torch.no_grad()
def capture_steps(model: MedusaModel, steps: StaticSteps, drafter: Drafter, acceptance: Acceptance | None = None
                  ) -> None:
    """On a GPU, capture each tree's step of `drafter` accepting by `acceptance` over the smallest cache `steps`
    lends, as the first answer would: a step of each over a scratch prompt (a sampling rule draws its numbers from a
    generator of its own here, leaving the answers' alone)."""
    cache = steps.borrow_cache(1)
    try:
        prompt = [0] * SCRATCH_PROMPT
        _, hidden = prefill(model, [prompt], cache)
        if isinstance(acceptance, RuleAcceptance):
            acceptance = copy.copy(acceptance)
            acceptance.generator = None
        stepper = StaticStepper(steps, drafter, cache, 0, hidden[0], prompt, acceptance)
        for tree, chain_nodes in step_trees(drafter):
            stepper.step_tree(tree, chain_nodes, None if chain_nodes is None else torch.zeros_like(chain_nodes))
    finally:
        steps.give_back(cache)


def decode_step(model: MedusaModel, cache: TreeCache, rows: list[tuple[Drafter, Acceptance, DecodeState]],
                stats: list[GenerationStats | None] | None = None
                ) -> list[tuple[Accepted, list[int], torch.Tensor]]:
    r"""
    One tree step for every row of the cache: propose, verify all rows' trees in one forward, accept, compact.

    The rows of a batch verify one tree, the union of their drafts' trees.

    Returns, per row: (accepted path, new tokens (accepted drafts + the bonus), hidden states [n, H] of the
    accepted nodes, the last one the one that predicted the bonus). Each step is recorded in `stats` and, for a
    drafter that learns from its results, passed to its `observe`.
    """
    drafts, draft_seconds = [], []
    for drafter, _, state in rows:
        start = time.perf_counter()
        drafts.append(drafter.propose(state))
        draft_seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    if all(draft.tree.paths == drafts[0].tree.paths for draft in drafts):
        tree, tokens = drafts[0].tree, torch.stack([draft.tokens for draft in drafts])
    else:
        tree, tokens = _merge(drafts)
        drafts = [Draft(tree, row_tokens) for row_tokens in tokens]
    greedy = all(type(acceptance) is GreedyAcceptance for _, acceptance, _ in rows)
    internal_only = greedy and tree.size - tree.internal.numel() >= LEAVES_TO_SKIP
    logits, hidden = verify(model, tree, tokens, cache, internal_only)
    if greedy:
        paths, lengths, bonus = GreedyAcceptance.accept_rows(tree, tokens, logits, internal_only)
        path_tokens = tokens.gather(1, paths)
        host = torch.cat([paths, path_tokens, lengths[:, None], bonus[:, None]], dim=1).tolist()  # one copy
        width = paths.shape[1]
        at_leaf = [b for b, row in enumerate(host) if row[-1] < 0]  # accepted down to a leaf: its bonus is owed
        if at_leaf:
            ends = [host[b][host[b][-2]] for b in at_leaf]
            for b, token in zip(at_leaf, _leaf_bonus(model, hidden[at_leaf, ends])):
                host[b][-1] = token
        accepted = [Accepted(paths[b, : row[-2] + 1], row[-1]) for b, row in enumerate(host)]
        nodes = [row[: row[-2] + 1] for row in host]
        new = [row[width + 1 : width + row[-2] + 1] + [row[-1]] for row in host]
    else:
        accepted = [acceptance.accept(draft, logits[b]) for b, (draft, (_, acceptance, _))
                    in enumerate(zip(drafts, rows))]
        nodes = [a.nodes.tolist() for a in accepted]
        new = [draft.tokens[a.nodes[1:]].tolist() + [a.bonus] for draft, a in zip(drafts, accepted)]
    verify_seconds = time.perf_counter() - start
    cache.commit(nodes)
    for b, (drafter, _, _) in enumerate(rows):
        if stats is not None and stats[b] is not None:
            stats[b].record(tree.paths, nodes[b])
            stats[b].draft_seconds += draft_seconds[b]
            stats[b].verify_seconds += verify_seconds
        if hasattr(drafter, "observe"):
            drafter.observe(drafts[b], accepted[b])
    return [(accepted[b], new[b], hidden[b, accepted[b].nodes]) for b in range(len(rows))]


def tree_decode_step(model: MedusaModel, drafter: Drafter, acceptance: Acceptance, cache: TreeCache,
                     state: DecodeState, stats: GenerationStats | None = None
                     ) -> tuple[Accepted, list[int], torch.Tensor]:
    """`decode_step` for a batch of one."""
    return decode_step(model, cache, [(drafter, acceptance, state)], [stats])[0]


def _cut(tokens: list[int], limit: int, eos: set[int]) -> tuple[list[int], bool]:
    """Trim a step's tokens at the first EOS (kept) or at `limit`; report whether decoding must stop."""
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:limit], len(tokens) >= limit


def _check(model: MedusaModel, requests: Sequence[Request]) -> None:
    """One-line errors for requests that cannot run (together)."""
    drafters = [request.drafter for request in requests if getattr(request.drafter, "per_sequence", False)]
    if len({id(d) for d in drafters}) < len(drafters):
        raise MedusaError("This drafter keeps state per sequence: give each request its own.")
    context = getattr(model.backbone.config.get_text_config(), "max_position_embeddings", None)
    for request in requests:
        if not request.input_ids:
            raise MedusaError("A prompt needs at least one token.")
        tree_size = request.drafter.tree.size
        needed = len(request.input_ids) + request.max_new_tokens + tree_size
        if context is not None and needed > context:
            raise MedusaError(
                f"The prompt ({len(request.input_ids)} tokens) plus max_new_tokens ({request.max_new_tokens}) and "
                f"the tree ({tree_size}) exceed the model's context of {context} tokens; shorten the prompt or "
                "max_new_tokens.")


def decode(model: MedusaModel, requests: Sequence[Request], eos_token_ids: Sequence[int] = ()
           ) -> Iterator[tuple[int, list[int]]]:
    r"""
    Decode `requests` together in one batch, yielding (request index, its new tokens) after each forward that
    gave that request tokens. A request ends at an EOS (yielded), its `max_new_tokens` or its `stop`; it then
    leaves the batch, and the others go on.
    """
    if not requests:
        return
    _check(model, requests)
    deepest = max(request.drafter.tree.max_depth for request in requests)  # rows verify each other's nodes too
    for request in requests:
        request.stats.prompt_tokens = len(request.input_ids)
        request.stats.init_depths(deepest)
    live = [i for i, request in enumerate(requests) if request.max_new_tokens > 0]
    if not live:
        return
    width = max(len(requests[i].input_ids) for i in live)
    most_new = max(requests[i].max_new_tokens for i in live)
    trees = sum(requests[i].drafter.tree.size for i in live)  # bounds the union of the rows' trees
    max_len = width + most_new + trees + deepest
    # one sequence of a drafter and rule that one graph steps (`static_step.py`), over a cache it lends
    steps = static_steps(model, requests[live[0]].drafter, requests[live[0]].acceptance) if len(live) == 1 else None
    cache = steps.borrow_cache(max_len) if steps else TreeCache(model.backbone, len(live), max_len)
    try:
        yield from _decode_in(cache, steps, model, requests, live, set(eos_token_ids))
    finally:
        if steps:
            steps.give_back(cache)


def _decode_in(cache: TreeCache, steps: StaticSteps | None, model: MedusaModel, requests: Sequence[Request],
               live: list[int], eos: set[int]) -> Iterator[tuple[int, list[int]]]:
    """`decode`'s loop over the requests `live` (their indices), in `cache`; stepped by `steps` where given."""
    start = time.perf_counter()
    prompts = [requests[i].input_ids for i in live]
    width = max(len(p) for p in prompts)
    logits, hidden = prefill(model, prompts, cache)
    rows, finished = [], []
    for b, i in enumerate(live):
        request = requests[i]
        root = request.acceptance.first_token(logits[b])
        request.stats.prefill_seconds = time.perf_counter() - start
        request.stats.new_tokens = 1
        row = _Row(i, request, request.input_ids + [root], [root], hidden[b, width - len(request.input_ids):])
        rows.append(row)
        yield i, [root]
        stop = request.stop is not None and request.stop(row.new_ids) is not None
        if root in eos or request.max_new_tokens == 1 or stop:
            finished.append(b)

    stepper = None
    if steps is not None and not finished:
        stepper = StaticStepper(steps, rows[0].request.drafter, cache, rows[0].sequence[-1], rows[0].hidden,
                                rows[0].request.input_ids, rows[0].request.acceptance)
    start = time.perf_counter()
    while True:
        if finished:
            rows = [row for b, row in enumerate(rows) if b not in finished]
            if not rows:
                return
            cache.keep_rows([b for b in range(cache.batch_size) if b not in finished])
            finished = []
        if stepper is not None:
            results = [(None, *stepper.step(rows[0].sequence, rows[0].request.stats))]
        else:
            results = decode_step(model, cache, [
                (row.request.drafter, row.request.acceptance,
                 DecodeState(row.sequence, row.sequence[-1], row.hidden[-1], fresh_hidden=row.hidden))
                for row in rows], [row.request.stats for row in rows])
        for b, (row, (_, tokens, hidden)) in enumerate(zip(rows, results)):
            request = row.request
            tokens, done = _cut(tokens, request.max_new_tokens - len(row.new_ids), eos)
            if request.stop is not None and (keep := request.stop(row.new_ids + tokens)) is not None:
                tokens, done = tokens[: max(keep - len(row.new_ids), 0)], True
            row.sequence += tokens
            row.new_ids += tokens
            row.hidden = hidden
            request.stats.new_tokens = len(row.new_ids)
            request.stats.decode_seconds = time.perf_counter() - start
            if tokens:
                yield row.index, tokens
            if done:
                finished.append(b)


def generate_ids(
    model: MedusaModel,
    input_ids: torch.Tensor,
    drafter: Drafter,
    acceptance: Acceptance | None = None,
    max_new_tokens: int = 128,
    eos_token_ids: Sequence[int] = (),
    stop: Callable[[list[int]], int | None] | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[list[int]]:
    r"""
    Decode from `input_ids` ([1, L] or [L]), yielding the new tokens of each backbone forward.

    Args:
        drafter: fills the tree each step (e.g. `MedusaDrafter(model, build_tree("cpu-8"))`).
        acceptance: `GreedyAcceptance()` (the default, exact) or another rule.
        eos_token_ids: decoding stops after any of these (it is yielded).
        stop: called with all new tokens so far; returns how many to keep when a stop condition is met.
        stats: filled in as decoding goes.
    """
    request = Request(input_ids.reshape(-1).tolist(), drafter, acceptance or GreedyAcceptance(), max_new_tokens,
                      stop, stats if stats is not None else GenerationStats())
    for _, tokens in decode(model, [request], eos_token_ids):
        yield tokens


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: GenerationStats


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, raw: bool = False) -> torch.Tensor:
    """[1, L] ids: the chat template around one user turn, or the raw text with `raw=True`."""
    if raw or tokenizer.chat_template is None:
        return tokenizer(prompt, return_tensors="pt")["input_ids"]
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
    )
    return encoded["input_ids"]


def stop_strings_check(tokenizer: PreTrainedTokenizerBase, strings: Sequence[str]) -> StopStrings | None:
    return StopStrings(tokenizer, strings) if any(strings) else None


def eos_token_ids(model: MedusaModel, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    eos = model.backbone.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def stream(model: MedusaModel, tokenizer: PreTrainedTokenizerBase, prompt: str, drafter: Drafter,
           acceptance: Acceptance | None = None, max_new_tokens: int = 128, stop_strings: Sequence[str] = (),
           raw: bool = False, stats: GenerationStats | None = None) -> Iterator[str]:
    """Yield the new text piece by piece as the tokens are accepted."""
    input_ids = encode_prompt(tokenizer, prompt, raw)
    text = TextStream(tokenizer)
    for chunk in generate_ids(model, input_ids, drafter, acceptance, max_new_tokens, eos_token_ids(model, tokenizer),
                              stop_strings_check(tokenizer, stop_strings), stats):
        if piece := text.add(chunk):
            yield piece
    if piece := text.flush():
        yield piece


def generate(model: MedusaModel, tokenizer: PreTrainedTokenizerBase, prompt: str, drafter: Drafter,
             acceptance: Acceptance | None = None, max_new_tokens: int = 128, stop_strings: Sequence[str] = (),
             raw: bool = False) -> Generation:
    """Decode a whole answer; returns its text, new token ids and statistics."""
    stats = GenerationStats()
    input_ids = encode_prompt(tokenizer, prompt, raw)
    ids = [t for chunk in generate_ids(model, input_ids, drafter, acceptance, max_new_tokens,
                                       eos_token_ids(model, tokenizer), stop_strings_check(tokenizer, stop_strings), stats)
           for t in chunk]
    return Generation(tokenizer.decode(ids, skip_special_tokens=True), ids, stats)


def generate_batch(model: MedusaModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str],
                   drafters: Sequence[Drafter], acceptances: Sequence[Acceptance] | None = None,
                   max_new_tokens: int = 128, stop_strings: Sequence[str] = (), raw: bool = False) -> list[Generation]:
    """Decode several prompts together in one batch, one drafter per prompt (`make_drafters` gives them);
    each answer is what `generate` gives for its prompt alone (exactly so with greedy acceptance in fp32)."""
    acceptances = acceptances or [GreedyAcceptance()] * len(prompts)
    if not len(prompts) == len(drafters) == len(acceptances):
        raise MedusaError(f"{len(prompts)} prompts need as many drafters and acceptance rules, got "
                          f"{len(drafters)} and {len(acceptances)}.")
    requests = [Request(encode_prompt(tokenizer, prompt, raw)[0].tolist(), drafter, acceptance, max_new_tokens,
                        stop_strings_check(tokenizer, stop_strings))
                for prompt, drafter, acceptance in zip(prompts, drafters, acceptances)]
    ids: list[list[int]] = [[] for _ in requests]
    for index, tokens in decode(model, requests, eos_token_ids(model, tokenizer)):
        ids[index] += tokens
    return [Generation(tokenizer.decode(new, skip_special_tokens=True), new, request.stats)
            for new, request in zip(ids, requests)]
