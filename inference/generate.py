"""The decoding loop: prefill, then tree steps (propose -> verify in one forward -> accept -> compact)."""

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from medusa_heads.backbone import backbone_forward
from medusa_heads.errors import MedusaError
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers

from .acceptance import GreedyAcceptance
from .cache import check_compactable, compact_cache, new_cache
from .draft import Acceptance, Accepted, DecodeState, Draft, Drafter
from .text import StopStrings, TextStream


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

    def record(self, tree: TreeBuffers, accepted: Accepted) -> None:
        """One step: the path `accepted` in the drafted `tree`."""
        self.accepted_lengths.append(accepted.depth + 1)
        for d, rank in enumerate(tree.rank[accepted.nodes[1:]].tolist()):
            self.depth_accepts[d] += 1
            row = self.rank_accepts[d]
            row.extend([0] * (rank + 1 - len(row)))
            row[rank] += 1
        if bool((tree.parent == accepted.nodes[-1]).any()):  # its children were drafted and all rejected
            self.first_rejections[accepted.depth] += 1

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
            "tokens_per_second": self.tokens_per_second,
        }


@torch.no_grad()
def prefill(model: MedusaModel, input_ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids: [1, L] -> (logits [V] at the last prompt position, hidden states [L, H] at all of them)."""
    logits, hidden = backbone_forward(model.backbone, input_ids, cache, logits_to_keep=1)
    return logits[0, -1], hidden[0]


@torch.no_grad()
def verify(model: MedusaModel, draft: Draft, cache, past_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One backbone forward over every tree node -> (logits [T, V], hidden [T, H])."""
    tree = draft.tree
    seen_past = torch.ones(tree.size, past_len, dtype=torch.bool, device=tree.mask.device)
    mask = torch.cat([seen_past, tree.mask], dim=1)[None, None]  # [1, 1, T, past + T]
    positions = (past_len + tree.depth)[None]  # [1, T]
    logits, hidden = backbone_forward(model.backbone, draft.tokens[None], cache, positions, mask)
    return logits[0], hidden[0]


def tree_decode_step(model: MedusaModel, drafter: Drafter, acceptance: Acceptance, cache,
                     state: DecodeState, stats: GenerationStats | None = None
                     ) -> tuple[Accepted, list[int], torch.Tensor]:
    """Returns (accepted path, new tokens: accepted drafts + bonus, hidden states [n, H] of the accepted nodes,
    the last one the one that predicted the bonus).
    The step is recorded in `stats` and, for a drafter that learns from its results, passed to its `observe`."""
    past_len = cache.get_seq_length()
    draft = drafter.propose(state)
    logits, hidden = verify(model, draft, cache, past_len)
    accepted = acceptance.accept(draft, logits)
    compact_cache(cache, past_len, accepted.nodes)
    if stats is not None:
        stats.record(draft.tree, accepted)
    if hasattr(drafter, "observe"):
        drafter.observe(draft, accepted)
    new = draft.tokens[accepted.nodes[1:]].tolist() + [accepted.bonus]
    return accepted, new, hidden[accepted.nodes]


def _cut(tokens: list[int], limit: int, eos: set[int]) -> tuple[list[int], bool]:
    """Trim a step's tokens at the first EOS (kept) or at `limit`; report whether decoding must stop."""
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:limit], len(tokens) >= limit


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
    acceptance = acceptance or GreedyAcceptance()
    stats = stats if stats is not None else GenerationStats()
    input_ids = input_ids.reshape(1, -1).to(model.device)
    tree_size = drafter.tree.size
    context = getattr(model.backbone.config.get_text_config(), "max_position_embeddings", None)
    needed = input_ids.shape[1] + max_new_tokens + tree_size
    if context is not None and needed > context:
        raise MedusaError(
            f"The prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) and the tree "
            f"({tree_size}) exceed the model's context of {context} tokens; shorten the prompt or max_new_tokens."
        )
    stats.prompt_tokens = input_ids.shape[1]
    stats.init_depths(drafter.tree.max_depth)
    eos = set(eos_token_ids)
    if max_new_tokens <= 0:
        return

    start = time.perf_counter()
    cache = new_cache(model.backbone)
    logits, hidden = prefill(model, input_ids, cache)
    check_compactable(cache)
    root = acceptance.first_token(logits)
    stats.prefill_seconds = time.perf_counter() - start
    sequence = input_ids[0].tolist() + [root]
    new_ids = [root]
    stats.new_tokens = 1
    done = root in eos or max_new_tokens == 1 or (stop is not None and stop(new_ids) is not None)
    yield [root]

    start = time.perf_counter()
    while not done:
        state = DecodeState(sequence, root, hidden[-1], fresh_hidden=hidden)
        _, tokens, hidden = tree_decode_step(model, drafter, acceptance, cache, state, stats)
        tokens, done = _cut(tokens, max_new_tokens - len(new_ids), eos)
        if stop is not None and (keep := stop(new_ids + tokens)) is not None:
            tokens, done = tokens[: max(keep - len(new_ids), 0)], True
        sequence += tokens
        new_ids += tokens
        root = tokens[-1] if tokens else root
        stats.new_tokens = len(new_ids)
        stats.decode_seconds = time.perf_counter() - start
        if tokens:
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
