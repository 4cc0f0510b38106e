"""What the server's worker runs: requests (`Job`) decoded with the runtime, their text and events, their metrics."""

import asyncio
import logging
import threading
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from medusa_heads.backbone import load_backbone
from medusa_heads.inference import GenerationStats, Request, decode, make_acceptance, make_drafter
from medusa_heads.inference.draft import Acceptance, DecodeState, Draft, Drafter
from medusa_heads.inference.generate import eos_token_ids, stop_strings_check
from medusa_heads.inference.registry import default_drafter
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
    # Sampled with a seed: decoded with the server's drafter in a batch of any size, because which tokens a seed
    # draws depends on the drafts (the seed gives the same answer alone and under load).
    seeded: bool = False
    sampling: dict = field(default_factory=dict)  # the temperature and acceptance rule used, told in its response
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


@dataclass
class Row:
    """A request being decoded in a batch: its drafter (logged), statistics, text and what it has been sent."""

    job: Job
    drafter_name: str
    drafter: DraftLog
    text: StopText
    stop_strings: Callable[[list[int]], int | None] | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    ids: list[int] = field(default_factory=list)
    first: float | None = None  # when its first token came
    recorded: int = 0  # its steps recorded in the metrics
    timed: tuple[float, float] = (0.0, 0.0)  # its drafting and verification seconds recorded in the metrics
    keep: int | None = None  # its new ids to keep, once `stop` has ended it
    failed: bool = False

    @property
    def drafter_config(self) -> str:
        return f"{self.drafter_name} drafter ({self.drafter.tree.size} tree nodes)"

    def stop(self, new_ids: list[int]) -> int | None:
        """The request's `stop` for the runtime: its stop strings, and the end of a cancelled or failed request
        (it leaves the batch at the next step)."""
        if self.job.cancelled.is_set() or self.failed:
            self.keep = len(new_ids)
        elif self.stop_strings is not None:
            self.keep = self.stop_strings(new_ids)
        return self.keep

    def done(self, eos: set[int]) -> bool:
        """Whether decoding has ended for it (the runtime yields nothing more for it)."""
        return (self.failed or (self.keep is not None and len(self.ids) >= self.keep)
                or len(self.ids) >= self.job.max_tokens or bool(self.ids) and self.ids[-1] in eos)


class Engine:
    r"""
    Decodes requests together with one model and records them in its `metrics`: a fresh drafter per request
    (drafters may keep per-sequence state, and the adaptive one learns from its steps, so one request must not
    shape another's drafts or, under sampling, its random draws), the request's own acceptance rule and RNG.

    `decode(jobs)` is what the scheduler calls with the requests it took from the queue, at most
    `batch_capacity` of them: they are decoded in one batch, each leaving it when it ends. In batches of more than
    one request, those without a seed draft what `configs/batching.json` gives for the batch size (measured by
    benchmarks/batch_throughput.py): smaller trees as the batch grows, then nothing.
    """

    batch_capacity = 64  # bounds one batch's KV cache; `--max-batch` chooses below it

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
        self.eos = set(eos_token_ids(model, tokenizer))

    def new_drafter(self) -> Drafter:
        return make_drafter(self.model, self.drafter_name, **self.drafter_options)

    def batch_drafter(self, job: Job, rows: int) -> tuple[str, dict]:
        """The drafter name and options for `job` in a batch of `rows` requests."""
        if rows == 1 or job.seeded:
            return self.drafter_name, self.drafter_options
        return default_drafter(self.model.backbone.dtype, rows)

    def rule(self, temperature: float) -> str:
        """The acceptance rule at `temperature`: greedy at 0, else the server's sampling rule."""
        return "greedy" if temperature == 0 else self.sampling_rule

    def acceptance(self, temperature: float, top_p: float, top_k: int, seed: int | None) -> Acceptance:
        """The acceptance of `rule(temperature)`; MedusaError for options the rule refuses."""
        if (rule := self.rule(temperature)) == "greedy":
            return make_acceptance(rule)
        return make_acceptance(rule, temperature, seed=seed, device=self.model.device, top_k=top_k, top_p=top_p)

    def decode(self, jobs: list[Job]) -> None:
        """Decode `jobs` in one batch, sending each its events; requests cancelled meanwhile leave the batch at
        its next step."""
        for job in jobs:
            if job.cancelled.is_set():
                self.metrics.requests.labels("cancelled").inc()
        jobs = [job for job in jobs if not job.cancelled.is_set()]
        if not jobs:
            return
        self.metrics.batch_sizes.observe(len(jobs))
        self.metrics.batch_size.set(len(jobs))
        running: list[Row] | None = None
        try:
            rows = [self._row(job, len(jobs)) for job in jobs]
            log.info("a batch of %d: %s", len(rows), ", ".join(
                f"{n} with {config}" for config, n in Counter(row.drafter_config for row in rows).items()))
            requests = [Request(row.job.prompt_ids, row.drafter, row.job.acceptance, row.job.max_tokens, row.stop,
                                row.stats) for row in rows]
            running = list(rows)
            with closing(decode(self.model, requests, self.eos)) as steps:
                for index, tokens in steps:
                    self._guard(rows[index], self._add, tokens)
                    for row in [row for row in running if row.done(self.eos)]:
                        running.remove(row)
                        self._guard(row, self._finish)
                        self.metrics.batch_size.set(len(running))
        # The worker outlives any one batch: whatever failed fails the requests still running, the server goes on.
        except Exception as err:  # noqa: BLE001
            log.exception("batch failed")
            for job in jobs if running is None else [row.job for row in running]:
                self._fail(job, err)
            running = []
        for row in running:  # ended without new tokens (cut by a stop string before they were yielded)
            self._guard(row, self._finish)
        self.metrics.batch_size.set(0)

    def _row(self, job: Job, rows: int) -> Row:
        name, options = self.batch_drafter(job, rows)
        drafter = DraftLog(make_drafter(self.model, name, **options))
        return Row(job, name, drafter, StopText(self.tokenizer, job.stop), stop_strings_check(self.tokenizer, job.stop))

    def _guard(self, row: Row, work: Callable, *args) -> None:
        """`work(row, *args)`; if it raises, the request fails alone and leaves the batch at its next step."""
        if row.failed:
            return
        try:
            work(row, *args)
        # A bug in one request's text or events must not end the others: it is logged and answered as a server error.
        except Exception as err:  # noqa: BLE001
            log.exception("request failed")
            row.failed = True
            self._fail(row.job, err)

    def _fail(self, job: Job, err: Exception) -> None:
        self.metrics.requests.labels("error").inc()
        job.emit(Failed(f"{type(err).__name__}: {err}"))

    def _add(self, row: Row, tokens: list[int]) -> None:
        """New tokens of `row`: metrics, and the text they complete to its client."""
        job = row.job
        if row.first is None:
            row.first = time.perf_counter()
            self.metrics.ttft.observe(row.first - job.arrived)
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        row.ids += tokens
        self.metrics.emitted_tokens.inc(len(tokens))
        self._record_steps(row)
        if not job.cancelled.is_set() and (piece := row.text.add(tokens)):
            job.emit(Piece(piece))

    def _finish(self, row: Row) -> None:
        """`row` has ended: the rest of its text and its final event."""
        job = row.job
        self._record_steps(row)  # steps a stop string cut
        if job.cancelled.is_set():
            self.metrics.requests.labels("cancelled").inc()
            return
        if piece := row.text.finish():
            job.emit(Piece(piece))
        end = time.perf_counter()
        self.metrics.latency.observe(end - job.arrived)
        if len(row.ids) > 1:
            self.metrics.tpot.observe((end - row.first) / (len(row.ids) - 1))
        self.metrics.requests.labels("ok").inc()
        finish = "stop" if row.text.stopped or row.ids[-1] in self.eos else "length"
        job.emit(Finished(finish, len(job.prompt_ids), len(row.ids), self._summary(row)))

    def _record_steps(self, row: Row) -> None:
        """Record in the metrics the request's steps and their time since the last call."""
        stats = row.stats
        for (drafted, depth), length in zip(row.drafter.trees[row.recorded:], stats.accepted_lengths[row.recorded:]):
            self.metrics.record_step(drafted, depth, length)
        row.recorded = len(stats.accepted_lengths)
        self.metrics.draft_seconds.inc(stats.draft_seconds - row.timed[0])
        self.metrics.verification_seconds.inc(stats.verify_seconds - row.timed[1])
        row.timed = (stats.draft_seconds, stats.verify_seconds)

    def _summary(self, row: Row) -> dict:
        """The request's own speculative statistics, the `speculative` field of its response."""
        stats = row.stats
        return {"drafter": row.drafter_name, **row.job.sampling, "steps": stats.steps,
                "draft_tokens": sum(n for n, _ in row.drafter.trees),
                "accepted_tokens": sum(stats.accepted_lengths) - stats.steps,
                "mean_accepted_length": round(stats.mean_accepted_length, 4),
                "draft_seconds": round(stats.draft_seconds, 6), "verification_seconds": round(stats.verify_seconds, 6)}
