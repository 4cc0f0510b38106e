"""The server's Prometheus metrics, in a registry of their own (one per app, so that two apps in one process, as in
tests, do not share counters). Speculative ones carry `speculative` in their names."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
REQUEST_STATUSES = ("ok", "cancelled", "rejected", "invalid", "error")


class ServerMetrics:
    r"""
    Counters, histograms and gauges of one server. The worker thread records steps and requests; prometheus_client
    is thread-safe.

    Args:
        max_depth: the deepest tree the drafter proposes; sizes the accepted-length buckets (1 .. max_depth + 1).
    """

    def __init__(self, max_depth: int):
        self.registry = CollectorRegistry()
        r = self.registry
        self.draft_tokens = Counter("medusa_speculative_draft_tokens", "Drafted tokens verified (tree nodes beyond "
                                    "the root)", registry=r)
        self.accepted_tokens = Counter("medusa_speculative_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.steps = Counter("medusa_speculative_verification_steps", "Verification forwards (tree steps)",
                             registry=r)
        self.accepted_length = Histogram(
            "medusa_speculative_accepted_length", "Tokens committed per verification step (accepted drafts + the "
            "backbone's own token)", buckets=tuple(range(1, max_depth + 2)), registry=r)
        self.draft_seconds = Counter("medusa_speculative_draft_seconds", "Seconds the requests' steps spent proposing "
                                     "drafts", registry=r)
        self.verification_seconds = Counter(
            "medusa_speculative_verification_seconds", "Seconds the requests' steps spent verifying: the backbone's "
            "forward and the acceptance rule (a batch's forward counts once for each request in it, as its steps "
            "do)", registry=r)
        self.depth_drafted = Counter("medusa_speculative_depth_drafted", "Steps whose tree had nodes at this depth",
                                     ["depth"], registry=r)
        self.depth_accepted = Counter("medusa_speculative_depth_accepted", "Steps whose accepted path reached this "
                                      "depth", ["depth"], registry=r)
        self.emitted_tokens = Counter("medusa_generation_tokens", "Tokens returned to clients (completion tokens)",
                                      registry=r)
        self.prompt_tokens = Counter("medusa_prompt_tokens", "Prompt tokens of the requests decoded", registry=r)
        self.requests = Counter("medusa_requests", "Completion requests by outcome: ok, cancelled (the client went "
                                "away), rejected (queue full), invalid (bad request), error", ["status"], registry=r)
        for status in REQUEST_STATUSES:
            self.requests.labels(status)
        self.latency = Histogram("medusa_request_latency_seconds", "Arrival to last token of finished requests",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("medusa_time_to_first_token_seconds", "Arrival (queueing included) to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("medusa_time_per_output_token_seconds", "Per token after the first, of finished "
                              "requests", buckets=TOKEN_BUCKETS, registry=r)
        self.queue_depth = Gauge("medusa_queue_depth", "Requests waiting for the worker", registry=r)
        self.batch_size = Gauge("medusa_running_batch_size", "Requests being decoded (rows of the running batch)",
                                registry=r)
        self.batch_sizes = Histogram("medusa_batch_size", "Requests per batch, when it starts",
                                     buckets=BATCH_BUCKETS, registry=r)

    def record_step(self, drafted: int, drafted_depth: int, accepted_length: int) -> None:
        """One verification step: `drafted` nodes besides the root, up to depth `drafted_depth`; `accepted_length`
        tokens committed (the accepted drafts + the bonus)."""
        self.steps.inc()
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted_length - 1)
        self.accepted_length.observe(accepted_length)
        for depth in range(1, drafted_depth + 1):
            self.depth_drafted.labels(str(depth)).inc()
        for depth in range(1, accepted_length):
            self.depth_accepted.labels(str(depth)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
