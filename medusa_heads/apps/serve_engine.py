"""What the server's worker runs: requests (`Job`) decoded with the runtime, their text and events, their metrics."""

import asyncio
import logging
import threading
import time
from contextlib import closing
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from medusa_heads.backbone import load_backbone
from medusa_heads.inference import GenerationStats, generate_ids, make_acceptance, make_drafter
from medusa_heads.inference.draft import Acceptance, DecodeState, Draft, Drafter
from medusa_heads.inference.generate import eos_token_ids, stop_strings_check
from medusa_heads.inference.text import TextStream
from medusa_heads.model import MedusaModel

from .serve_metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass
class Piece:
    text: str


@dataclass
class Finished:
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int
    speculative: dict


@dataclass
class Failed:
    message: str


Event = Piece | Finished | Failed


@dataclass
class Job:
    """One request: made by a route on the event loop, decoded by the worker thread, which hands back events."""

    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    acceptance: Acceptance
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: Event) -> None:
        """From the worker thread: queue `event` for the route."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class DraftLog:
    """A drafter that notes each step's tree (drafted nodes besides the root, depth) for the metrics; in all else
    the drafter it wraps (`tree`, and `observe` when that one has it)."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.trees: list[tuple[int, int]] = []

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)

    def propose(self, state: DecodeState) -> Draft:
        draft = self.drafter.propose(state)
        self.trees.append((draft.tree.size - 1, draft.tree.max_depth))
        return draft


class StopText:
    r"""
    The text of a streamed answer, cut before the first stop string (OpenAI leaves the stop string out). Text
    that might be the start of a stop string is held back until the next tokens tell.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str]):
        self.stream = TextStream(tokenizer)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.sent = 0
        self.stopped = False

    def _release(self, final: bool) -> str:
        text = self.stream.text
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.stopped = True
            end = min(found)
        else:
            end = len(text) if final else max(len(text) - self.hold, self.sent)
        piece, self.sent = text[self.sent : end], end
        return piece

    def add(self, ids: list[int]) -> str:
        """The new text that is sure to be part of the answer."""
        if self.stopped:
            return ""
        self.stream.add(ids)
        return self._release(final=False)

    def finish(self) -> str:
        """What is left, once decoding has ended."""
        if self.stopped:
            return ""
        self.stream.flush()
        return self._release(final=True)


class Engine:
    r"""
    Decodes requests with one model and records them in its `metrics`: a fresh drafter per request (drafters may keep per-sequence state, and the
    adaptive one learns from its steps, so one request must not shape another's drafts or, under sampling, its
    random draws), the request's own acceptance rule and RNG.

    `decode(jobs)` is what the scheduler calls with the requests it took from the queue, at most
    `batch_capacity` of them. The runtime decodes one sequence at a time, so that is 1; batched decoding replaces
    `decode` and raises it.
    """

    batch_capacity = 1

    def __init__(self, model: MedusaModel, tokenizer: PreTrainedTokenizerBase, drafter: str, drafter_options: dict,
                 sampling_rule: str):
        self.model, self.tokenizer = model, tokenizer
        self.drafter_name, self.sampling_rule = drafter, sampling_rule
        self.drafter_options = dict(drafter_options)
        if isinstance(self.drafter_options.get("draft_model"), str):  # loaded once, not per request
            self.drafter_options["draft_model"] = load_backbone(
                self.drafter_options["draft_model"], dtype=model.backbone.dtype, device=model.device)
        tree = self.new_drafter().tree
        self.tree_size = tree.size
        self.metrics = ServerMetrics(tree.max_depth)
        self.context = getattr(model.backbone.config.get_text_config(), "max_position_embeddings", None)
        self.eos = eos_token_ids(model, tokenizer)

    def new_drafter(self) -> Drafter:
        return make_drafter(self.model, self.drafter_name, **self.drafter_options)

    def acceptance(self, temperature: float, top_p: float, top_k: int, seed: int | None) -> Acceptance:
        """Greedy at temperature 0, else the server's sampling rule; MedusaError for options the rule refuses."""
        if temperature == 0:
            return make_acceptance("greedy")
        return make_acceptance(self.sampling_rule, temperature, seed=seed, device=self.model.device, top_k=top_k,
                               top_p=top_p)

    def decode(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._decode(job)

    def _decode(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.metrics.requests.labels("cancelled").inc()
            return
        try:
            self._run(job)
        # The worker outlives any one request: whatever failed is logged and answered as a server error.
        except Exception as err:  # noqa: BLE001
            log.exception("request failed")
            self.metrics.requests.labels("error").inc()
            job.emit(Failed(f"{type(err).__name__}: {err}"))

    def _run(self, job: Job) -> None:
        drafter = DraftLog(self.new_drafter())
        stats = GenerationStats()
        text = StopText(self.tokenizer, job.stop)
        ids: list[int] = []
        first, recorded = None, 0
        steps = generate_ids(self.model, torch.tensor(job.prompt_ids), drafter, job.acceptance, job.max_tokens,
                             self.eos, stop_strings_check(self.tokenizer, job.stop), stats)
        with closing(steps):
            for chunk in steps:
                if first is None:
                    first = time.perf_counter()
                    self.metrics.ttft.observe(first - job.arrived)
                    self.metrics.prompt_tokens.inc(len(job.prompt_ids))
                ids += chunk
                self.metrics.emitted_tokens.inc(len(chunk))
                recorded = self._record_steps(drafter.trees, stats.accepted_lengths, recorded)
                if piece := text.add(chunk):
                    job.emit(Piece(piece))
                if job.cancelled.is_set():
                    break
        self._record_steps(drafter.trees, stats.accepted_lengths, recorded)  # steps whose tokens a stop string cut away
        if job.cancelled.is_set():
            self.metrics.requests.labels("cancelled").inc()
            return
        if piece := text.finish():
            job.emit(Piece(piece))
        end = time.perf_counter()
        self.metrics.latency.observe(end - job.arrived)
        if len(ids) > 1:
            self.metrics.tpot.observe((end - first) / (len(ids) - 1))
        self.metrics.requests.labels("ok").inc()
        finish = "stop" if text.stopped or ids[-1] in self.eos else "length"
        job.emit(Finished(finish, len(job.prompt_ids), len(ids), self._summary(drafter.trees, stats)))

    def _record_steps(self, trees: list[tuple[int, int]], accepted_lengths: list[int], recorded: int) -> int:
        """Record in the metrics the request's steps after the first `recorded`; returns how many are now."""
        for (drafted, depth), length in zip(trees[recorded:], accepted_lengths[recorded:]):
            self.metrics.record_step(drafted, depth, length)
        return len(accepted_lengths)

    def _summary(self, trees: list[tuple[int, int]], stats: GenerationStats) -> dict:
        """The request's own speculative statistics, the `speculative` field of its response."""
        return {"drafter": self.drafter_name, "steps": stats.steps, "draft_tokens": sum(n for n, _ in trees),
                "accepted_tokens": sum(stats.accepted_lengths) - stats.steps,
                "mean_accepted_length": round(stats.mean_accepted_length, 4)}
