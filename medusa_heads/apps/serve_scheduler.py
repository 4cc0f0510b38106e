"""The request queue and the one worker thread that owns the model."""

import logging
import threading
from collections import deque

from .serve_engine import Engine, Job

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


class Scheduler:
    r"""
    A bounded queue of requests and one worker thread that takes them, as many at a time as the engine decodes
    together (`min(max_batch, engine.batch_capacity)`), and hands them to `engine.decode`. A request cancelled
    while it waits (its client went away) leaves the queue at once: it holds no slot.

    Args:
        max_queue: requests that may wait besides the ones being decoded; `submit` refuses more.
        max_batch: requests to decode together at most.
    """

    def __init__(self, engine: Engine, max_queue: int, max_batch: int):
        self.engine, self.metrics = engine, engine.metrics
        self.max_queue = max_queue
        self.batch = min(max_batch, engine.batch_capacity)
        if max_batch > self.batch:
            log.warning("--max-batch %d: decoding %d requests at a time at most", max_batch, self.batch)
        self.waiting: deque[Job] = deque()
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._work, name="medusa-heads-worker", daemon=True)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        """Queue `job`; `QueueFull` when `max_queue` requests are already waiting."""
        with self.changed:
            self._drop_cancelled()
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(self.max_queue)
            self.waiting.append(job)
            self.metrics.queue_depth.set(len(self.waiting))
            self.changed.notify()

    def take(self) -> list[Job]:
        """The next requests to decode, up to the batch; waits a while for one, else returns none."""
        with self.changed:
            if not self.waiting:
                self.changed.wait(timeout=0.2)
            self._drop_cancelled()
            jobs = [self.waiting.popleft() for _ in range(min(self.batch, len(self.waiting)))]
            self.metrics.queue_depth.set(len(self.waiting))
            return jobs

    def _drop_cancelled(self) -> None:
        kept = deque(job for job in self.waiting if not job.cancelled.is_set())
        if dropped := len(self.waiting) - len(kept):
            self.metrics.requests.labels("cancelled").inc(dropped)
            self.waiting = kept

    def _work(self) -> None:
        while not self.stopping.is_set():
            if jobs := self.take():
                self.engine.decode(jobs)
