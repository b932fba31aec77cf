"""What generation returns: RequestOutput, CompletionOutput and per-request metrics.

Names follow vLLM. Metrics are read from the request's timeline, recorded as things
happen; nothing re-derives timings elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTimeline:
    """Wall-clock times (time.perf_counter seconds); metrics and traces read these."""

    arrival: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    preemption_times: list[float] = field(default_factory=list)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]
    num_preemptions: int

    @classmethod
    def from_timeline(cls, timeline: RequestTimeline) -> RequestMetrics:
        times = list(timeline.token_times)
        return cls(
            arrival_time=timeline.arrival,
            first_scheduled_time=timeline.first_scheduled,
            first_token_time=times[0] if times else None,
            finished_time=timeline.finished,
            token_times=times,
            num_preemptions=len(timeline.preemption_times),
        )

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first generated token (seconds)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Every gap between consecutive tokens (ITL), in seconds."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: mean of the inter-token gaps."""
        gaps = self.inter_token_latencies
        return sum(gaps) / len(gaps) if gaps else None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # of the first sample (all share one arrival)
    # Disaggregated prefill: where the prompt's K/V wait for a decode instance.
    kv_transfer_params: dict | None = None
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then each
    # prompt token's entry (the token and the top ones), as for generated tokens.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # An embedding request (SamplingParams.pooling): its prompt's vector.
    pooled: list[float] | None = None
    # Set when the request failed alone (its samples finish with "error"; what they
    # had generated is dropped); the other requests of the step are unaffected.
    error: str | None = None


@dataclass
class EmbeddingOutput:
    """An embedding request's result (LLM.embed): its prompt's vector."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


def similarity(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two normalised embeddings (their dot product)."""
    return sum(x * y for x, y in zip(a, b, strict=True))


def relevance(scores: list[float]) -> float:
    """A cross-encoder's score of a pair from its head's activated outputs
    (PoolingParams' classify): its one label's sigmoid, or with several labels the
    last one's probability (a "relevant" label after "not relevant")."""
    return scores[-1]
