"""ServerMetrics: Prometheus metrics with vLLM's names under the ``tandem:`` prefix.

An EngineObserver: latencies come from each finished request's timeline (recorded by
the engine as things happen), counters and gauges from the StepStats after every
step. One registry per server, so that several servers in one process (tests) do not
collide.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from tandem.engine.observer import EngineObserver, StepStats
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import SchedulerOutput
from tandem.outputs import RequestMetrics
from tandem.spec_decode.stats import SpecDecodeStats

disable_created_metrics()

# Bucket edges as vLLM uses them, so that dashboards built for vLLM read ours.
LATENCY_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
REQUEST_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")
# Scrapes within this many seconds share one rendering: rendering holds the GIL and
# the metrics' locks, which a flood of scrapes would take from the engine thread.
RENDER_INTERVAL = 0.1


class ServerMetrics(EngineObserver):
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, text: str, buckets: list[float]):
            return Histogram(
                f"tandem:{name}", text, labels, registry=self.registry, buckets=buckets
            ).labels(model_name)

        def gauge(name: str, text: str):
            return Gauge(f"tandem:{name}", text, labels, registry=self.registry).labels(model_name)

        def counter(name: str, text: str):
            return Counter(f"tandem:{name}", text, labels, registry=self.registry).labels(
                model_name
            )

        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens.", ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS
        )
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Preemptions of finished requests.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache at admission."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Tokens found in the prefix cache at admission."
        )
        success = Counter(
            "tandem:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._seen_queries = self._seen_hits = 0
        self.spec_drafts = counter("spec_decode_num_drafts", "Verified drafts (one per request).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens the target accepted."
        )
        self.spec_accepted_per_position = Counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft.",
            [*labels, "position"],
            registry=self.registry,
        )
        self._model_name = model_name
        self._seen_spec = SpecDecodeStats()
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "KV bytes pulled from prefill.")
        self.kv_transfer_blocks = counter("kv_transfer_blocks", "KV blocks pulled from prefill.")
        self.kv_transfer_failures = counter("kv_transfer_failures", "KV pulls that failed.")
        self.kv_transfer_time = histogram(
            "kv_transfer_seconds", "Duration of one request's KV pull.", LATENCY_BUCKETS
        )
        self.kv_lease_expiries = counter(
            "kv_lease_expiries", "Leased prefill blocks released because nobody read them."
        )
        self.kv_leases = gauge("kv_leases", "Finished prefills holding blocks for a decode side.")
        self._seen_expiries = 0
        self._render_lock = threading.Lock()
        self._rendered: bytes | None = None
        self._rendered_at = 0.0

    def render(self) -> bytes:
        """The exposition text, at most RENDER_INTERVAL seconds old (thread-safe)."""
        with self._render_lock:
            now = time.monotonic()
            if self._rendered is None or now - self._rendered_at >= RENDER_INTERVAL:
                self._rendered, self._rendered_at = generate_latest(self.registry), now
            return self._rendered

    # -- EngineObserver ---------------------------------------------------------------

    def request_added(self, request: Request) -> None:
        self.prompt_tokens.inc(len(request.prompt_token_ids))

    def request_finished(self, request: Request) -> None:
        self.success[request.status.value].inc()
        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return
        metrics = RequestMetrics.from_timeline(request.timeline)
        self.preemptions.inc(metrics.num_preemptions)
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)

    def step_done(self, out: SchedulerOutput | None, stats: StepStats) -> None:
        self.generation_tokens.inc(stats.num_generated_tokens)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        # The manager counts prompt tokens looked up and found at each admission.
        self.prefix_queries.inc(stats.prefix_cache_queries - self._seen_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits - self._seen_hits)
        self._seen_queries, self._seen_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.kv_leases.set(stats.num_kv_leases)
        self.kv_lease_expiries.inc(stats.num_lease_expiries - self._seen_expiries)
        self._seen_expiries = stats.num_lease_expiries
        if stats.spec is None:
            return
        spec = stats.spec.minus(self._seen_spec)
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            if count:
                labels = (self._model_name, str(position))
                self.spec_accepted_per_position.labels(*labels).inc(count)
        self._seen_spec = stats.spec

    def transfer_done(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.kv_transfer_blocks.inc(num_blocks)
        self.kv_transfer_bytes.inc(num_bytes)
        self.kv_transfer_time.observe(seconds)

    def transfer_failed(self) -> None:
        self.kv_transfer_failures.inc()
