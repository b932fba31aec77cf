"""Engine settings as dataclasses; ``EngineConfig.from_kwargs`` sorts flat keyword
options (as ``LLM(...)`` and the CLI take them) into their sections and rejects
unknown ones by name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InvalidParameterError

SCHEDULING_POLICIES = ("chunked", "prefill-first")


@dataclass
class CacheConfig:
    block_size: int = 16
    # Size of the KV pool: num_blocks wins, then kv_cache_memory (bytes); otherwise a
    # fraction of GPU memory on CUDA, or a default budget on CPU.
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    # Reuse the KV blocks of prompt starts seen before (automatic prefix caching).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise InvalidParameterError("block_size", "must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidParameterError("num_blocks", "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidParameterError("gpu_memory_utilization", "must be in (0, 1]")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 128  # requests running at once
    long_prefill_token_threshold: int = 0  # cap on one request's chunk per step; 0: none
    scheduling_policy: str = "chunked"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise InvalidParameterError("max_num_batched_tokens", "must be >= 1")
        if self.max_num_seqs < 1:
            raise InvalidParameterError("max_num_seqs", "must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise InvalidParameterError("long_prefill_token_threshold", "must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidParameterError(
                "scheduling_policy",
                f"{self.scheduling_policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}",
            )


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses ``num_speculative_tokens`` tokens and the
    target model verifies them in the same forward as everything else."""

    method: str = "ngram"  # "ngram" (prompt lookup) | "draft" (a smaller model)
    num_speculative_tokens: int = 4
    model: str | None = None  # the draft model's folder (method "draft"; default: bundled)
    # Speculation stops while this many requests run: verifying k extra tokens per
    # request then costs more than it saves. On the bundled pair on a 2-core CPU, n-gram
    # lookup on code still paid at 64 (1.14x throughput, down from 1.67x at 32); see
    # docs/BENCHMARKS.md. None: never.
    disable_by_batch_size: int | None = 64
    # n-gram lookup: the longest and shortest suffix of the sequence to match.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidParameterError(
                "speculative_config.method",
                f"{self.method!r} is not one of {', '.join(SPECULATIVE_METHODS)}",
            )
        if self.num_speculative_tokens < 1:
            raise InvalidParameterError("speculative_config.num_speculative_tokens", "must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidParameterError(
                "speculative_config.prompt_lookup_min", "must be in [1, prompt_lookup_max]"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise InvalidParameterError("speculative_config.disable_by_batch_size", "must be >= 1")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        speculative = kwargs.pop("speculative_config", None)
        if isinstance(speculative, dict):
            unknown = set(speculative) - {f.name for f in dataclasses.fields(SpeculativeConfig)}
            if unknown:
                raise InvalidParameterError(
                    "speculative_config", f"unknown key(s): {', '.join(sorted(unknown))}"
                )
            speculative = SpeculativeConfig(**speculative)
        sections = {"cache": CacheConfig, "scheduler": SchedulerConfig}
        top = {f.name for f in dataclasses.fields(cls)} - set(sections) - {"model", "speculative"}
        values: dict[str, dict[str, Any]] = {name: {} for name in sections}
        own: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in top:
                own[key] = value
                continue
            section = next(
                (n for n, c in sections.items() if key in {f.name for f in dataclasses.fields(c)}),
                None,
            )
            if section is None:
                raise InvalidParameterError(key, "unknown engine option")
            values[section][key] = value
        return cls(
            model=model,
            **own,
            **{name: sections[name](**values[name]) for name in sections},
            speculative=speculative,
        )
