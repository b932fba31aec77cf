"""ServerMetrics: Prometheus metrics with vLLM's names under the ``tandem:`` prefix.

An EngineObserver: latencies come from each finished request's timeline (recorded by
the engine as things happen), counters and gauges from the StepStats after every
step. As vLLM counts: a request with n samples is one request in every per-request
histogram and in request_success (observed when its last sample ends: its earliest
first token, its latest finish); preemptions are counted when they happen. One
registry per server, so that several servers in one process (tests) do not collide.
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

from tandem.engine.observer import EngineObserver, StepStats, load_summary
from tandem.engine.request import Request, RequestStatus
from tandem.outputs import RequestMetrics
from tandem.step import SchedulerOutput, SpecDecodeStats

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
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort", "error")
# Scrapes within this many seconds share one rendering: rendering holds the GIL and
# the metrics' locks, which a flood of scrapes would take from the engine thread.
RENDER_INTERVAL = 0.1


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return buckets
            buckets.append(float(step * scale))
        scale *= 10


class ServerMetrics(EngineObserver):
    def __init__(self, model_name: str, max_model_len: int = 131072) -> None:
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
        self.preemptions = counter("num_preemptions", "Preemptions, counted as they happen.")
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Generated tokens of each finished request (all its samples).",
            token_buckets,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to finish.", REQUEST_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens run in each engine step.", ITERATION_TOKEN_BUCKETS
        )
        self._open_samples: dict[str, list[Request]] = {}
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
        self.spec_speculating = gauge(
            "spec_decode_requests_speculating",
            "Requests given draft slots in the last step (speculation switches itself off "
            "where it was measured not to pay).",
        )
        self.spec_switches = counter(
            "spec_decode_switches",
            "Times speculation was switched on or off for a batch size, as measured.",
        )
        self._model_name = model_name
        self._seen_spec = SpecDecodeStats()
        self._seen_switches = 0
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
        # A mixture of experts (StepStats.expert_load): where its tokens went.
        self.expert_tokens = Counter(
            "tandem:moe_expert_tokens",
            "Tokens routed to each expert (the expert's index; summed over layers).",
            [*labels, "expert"],
            registry=self.registry,
        )
        self.experts_read = histogram(
            "moe_experts_read_per_layer",
            "Distinct experts a layer read in a step (the mean over layers): what a step's "
            "weight reads grow with.",
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        )
        self.expert_imbalance = gauge(
            "moe_expert_imbalance",
            "Last step: the most tokens any expert took over the mean of the picked experts "
            "(1: even).",
        )
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
        if request.sample_index == 0:  # n samples share one prompt
            self.prompt_tokens.inc(len(request.prompt_token_ids))

    def request_finished(self, request: Request) -> None:
        samples = [request]
        if request.num_samples > 1:  # wait for the request's last sample
            samples = self._open_samples.setdefault(request.parent_id, [])
            samples.append(request)
            if len(samples) < request.num_samples:
                return
            del self._open_samples[request.parent_id]
        statuses = {s.status for s in samples}
        failed = statuses & {RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_ABORTED}
        status = (
            RequestStatus.FINISHED_ERROR
            if RequestStatus.FINISHED_ERROR in statuses
            else next(iter(failed), samples[-1].status)
        )
        self.success[status.value].inc()
        if not failed:
            self._observe(samples)

    def _observe(self, samples: list[Request]) -> None:
        timelines = [s.timeline for s in samples]
        arrival = timelines[0].arrival
        first_token = min((t.token_times[0] for t in timelines if t.token_times), default=None)
        scheduled = min(
            (t.first_scheduled for t in timelines if t.first_scheduled is not None), default=None
        )
        finished = max((t.finished for t in timelines if t.finished is not None), default=None)
        for timeline in timelines:
            for gap in RequestMetrics.from_timeline(timeline).inter_token_latencies:
                self.itl.observe(gap)
        self.request_prompt_tokens.observe(len(samples[0].prompt_token_ids))
        self.request_generation_tokens.observe(sum(s.num_output_tokens for s in samples))
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
        if finished is not None:
            self.e2e.observe(finished - arrival)
        if scheduled is not None:
            self.queue_time.observe(scheduled - arrival)
            if first_token is not None:
                self.prefill_time.observe(first_token - scheduled)
            if finished is not None:
                self.inference_time.observe(finished - scheduled)
        if first_token is not None and finished is not None:
            self.decode_time.observe(finished - first_token)

    def step_done(self, out: SchedulerOutput | None, stats: StepStats) -> None:
        self.generation_tokens.inc(stats.num_generated_tokens)
        if out is not None:
            self.preemptions.inc(len(out.preempted_ids))
            if out.num_batched_tokens:
                self.iteration_tokens.observe(out.num_batched_tokens)
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
        if stats.expert_load:
            self._observe_experts(stats.expert_load)
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
        if out is not None:
            self.spec_speculating.set(stats.num_speculating)
        self.spec_switches.inc(stats.spec_switches - self._seen_switches)
        self._seen_switches = stats.spec_switches

    def _observe_experts(self, load: tuple[tuple[int, ...], ...]) -> None:
        summary = load_summary(load)
        if not summary["expert_max_tokens"]:
            return
        for expert, tokens in enumerate(map(sum, zip(*load, strict=True))):
            if tokens:
                self.expert_tokens.labels(self._model_name, str(expert)).inc(tokens)
        self.experts_read.observe(summary["experts_read"])
        self.expert_imbalance.set(summary["expert_imbalance"])

    def transfer_done(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.kv_transfer_blocks.inc(num_blocks)
        self.kv_transfer_bytes.inc(num_bytes)
        self.kv_transfer_time.observe(seconds)

    def transfer_failed(self) -> None:
        self.kv_transfer_failures.inc()
