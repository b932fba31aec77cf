"""Engine settings as frozen dataclasses; ``EngineConfig.from_kwargs`` sorts flat
keyword options (as ``LLM(...)`` and the CLI take them) into their sections and
rejects unknown ones by name. Each field's ``help`` (and ``metavar``) metadata is what
the command line shows: its engine flags are generated from these fields
(tandem/cli/engine_args.py), so a new setting is one field here."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InvalidParameterError

# What the KV cache may store: the model's dtype, another float type, or int8 rows with
# scales (runner/kv_cache.py).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "int8")

SCHEDULING_POLICIES = ("chunked", "prefill-first")


def setting(default: Any, help: str, metavar: str | None = None, flag: str | None = None):
    """A config field with the text the command line shows for it."""
    return field(default=default, metadata={"help": help, "metavar": metavar, "flag": flag})


DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # a server's KV cache on CPU when none is given


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV cache block", "TOKENS")
    # Size of the KV pool: num_blocks wins, then kv_cache_memory (bytes); otherwise a
    # fraction of GPU memory on CUDA, or a default budget on CPU.
    num_blocks: int | None = setting(
        None, "KV cache blocks (default: what the memory budget holds)", "N"
    )
    kv_cache_memory: int | None = setting(
        None,
        "KV cache budget in bytes (default on CPU: 2 GiB, or 80%% of the memory available "
        "after the weights when that is less; a pool that does not fit is refused at start)",
        "BYTES",
    )
    gpu_memory_utilization: float = setting(
        0.9, "CUDA: the fraction of GPU memory for weights + KV cache", "FRACTION"
    )
    enable_prefix_caching: bool = setting(
        True, "reuse the KV blocks of prompt starts seen before (automatic prefix caching)"
    )
    kv_cache_dtype: str = setting(
        "auto",
        "auto (the model's dtype), bfloat16, fp8 (e4m3, saturating) or int8 (per token and "
        "head scales: a quarter of float32's bytes)",
        "DTYPE",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError(
                "kv_cache_dtype",
                f"{self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}",
            )
        if self.block_size < 1:
            raise InvalidParameterError("block_size", "must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidParameterError("num_blocks", "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidParameterError("gpu_memory_utilization", "must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = setting(2048, "the token budget of one step", "TOKENS")
    max_num_seqs: int = setting(128, "requests running at once", "N")
    long_prefill_token_threshold: int = setting(
        0, "cap on one request's prompt chunk per step (0: none)", "TOKENS"
    )
    scheduling_policy: str = setting(
        "chunked", f"one of {', '.join(SCHEDULING_POLICIES)}", "POLICY"
    )

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


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes run the model (tandem/executor/)."""

    tensor_parallel_size: int = setting(
        1, "ranks that each hold 1/N of every weight matrix and of the KV heads, one "
        "process each (torch.distributed), their hosts' CPU threads split between them",
        "N", "--tensor-parallel-size",
    )  # fmt: skip
    distributed_executor_backend: str = setting(
        "mp", "mp: this process starts the ranks (and `tandem worker` on other hosts); "
        "external_launcher: torchrun started every rank, each running this same program "
        "with its own engine (offline use, as vLLM's)", "BACKEND",
    )  # fmt: skip
    enable_expert_parallel: bool = setting(
        False, "a mixture's routed experts whole, a run of them on each tensor-parallel "
        "rank, instead of every expert split across the ranks as an MLP is (the default "
        "where an expert's intermediate size cuts into equal runs of whole blocks)",
    )  # fmt: skip
    cpu_bind: str = setting(
        "auto", "auto: each rank of a host on its own run of the host's CPUs (every "
        "thread pinned; a NUMA node each, memory bound there, where the ranks spread "
        "evenly over several); none: the ranks share them, only their thread counts split",
        "POLICY",
    )  # fmt: skip
    nnodes: int = setting(
        1, "hosts the ranks span, tensor_parallel_size / nnodes on each: this one (node "
        "rank 0) runs the engine, the others `tandem worker` with the same settings", "N",
    )  # fmt: skip
    node_rank: int = setting(0, "this host's place among nnodes (the engine's is 0)", "N")
    master_addr: str = setting(
        "127.0.0.1", "with nnodes > 1: the address of node 0, where the ranks meet", "ADDR"
    )
    master_port: int = setting(
        0, "with nnodes > 1: node 0's rendezvous port (required there; one host needs none)",
        "PORT",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL:
            raise InvalidParameterError(
                "tensor_parallel_size", f"must be in [1, {MAX_TENSOR_PARALLEL}]"
            )
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise InvalidParameterError(
                "distributed_executor_backend",
                f"{self.distributed_executor_backend!r} is not one of "
                f"{', '.join(EXECUTOR_BACKENDS)}",
            )
        if self.cpu_bind not in ("auto", "none"):
            raise InvalidParameterError("cpu_bind", f"{self.cpu_bind!r} is not one of auto, none")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise InvalidParameterError(
                "nnodes", "must be >= 1 and divide tensor_parallel_size (ranks per host)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidParameterError("node_rank", "must be in [0, nnodes)")
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            raise InvalidParameterError("master_port", "is required (1-65535) with nnodes > 1")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


MAX_TENSOR_PARALLEL = 64
EXECUTOR_BACKENDS = ("mp", "external_launcher")

SPECULATIVE_METHODS = ("ngram", "suffix", "draft", "layer_skip", "eagle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses ``num_speculative_tokens`` tokens and the
    target model verifies them in the same forward as everything else."""

    method: str = setting(
        "ngram", "ngram (prompt lookup), suffix (suffix tries over the request and recent "
        "outputs; k is the most it drafts), draft (a smaller model), layer_skip (the "
        "target without some of its layers) or eagle (a draft head trained by tandem "
        "train-draft)", "METHOD",
        "--speculative-method",
    )  # fmt: skip
    num_speculative_tokens: int = setting(4, "draft tokens per step (k)", "K")
    model: str | None = setting(
        None,
        "the draft model's folder (default: the bundled draft), or the EAGLE head's",
        "DIR",
        "--draft-model",
    )
    # On the bundled pair on a 2-core CPU, n-gram lookup on code still paid at 64
    # (docs/lab-notes/speculative-decoding.md).
    disable_by_batch_size: int | None = setting(
        64, "no speculation while this many requests run: verifying k more tokens each "
        "then costs more than it saves (None: never)", "N",
        "--speculative-disable-by-batch-size",
    )  # fmt: skip
    adaptive: bool = setting(
        True, "measure whether speculating pays (tokens per second with and without it, "
        "per batch size; each request's acceptance against its share of the cost) and "
        "switch it off where it does not (engine/spec_control.py); false: speculate "
        "whenever there are slots (seeded sampled outputs then repeat exactly)", None,
        "--speculative-adaptive",
    )  # fmt: skip
    skip_layers: str | None = setting(
        None, "layer_skip: the layers the draft skips, e.g. 8-21 (default: the middle half; "
        "tandem tune-layer-skip finds better ones)", "LAYERS", "--speculative-skip-layers",
    )  # fmt: skip
    prompt_lookup_max: int = setting(4, "n-gram: the longest suffix to match", "TOKENS")
    prompt_lookup_min: int = setting(1, "n-gram: the shortest suffix to match", "TOKENS")

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidParameterError(
                "speculative_config.method",
                f"{self.method!r} is not one of {', '.join(SPECULATIVE_METHODS)}",
            )
        if self.method == "eagle" and not self.model:
            raise InvalidParameterError(
                "speculative_config.model", "eagle needs the head's folder (tandem train-draft)"
            )
        if self.num_speculative_tokens < 1:
            raise InvalidParameterError("speculative_config.num_speculative_tokens", "must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidParameterError(
                "speculative_config.prompt_lookup_min", "must be in [1, prompt_lookup_max]"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise InvalidParameterError("speculative_config.disable_by_batch_size", "must be >= 1")


KV_ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated serving: this instance's role and how its KV connector behaves
    (tandem/serving/disagg_connector.py; `tandem serve --role`)."""

    role: str = setting(
        "both", "prefill: run prompts and keep their K/V for a decode instance; decode: "
        "pull prompts' K/V, then decode; both: neither", "ROLE", "--role",
    )  # fmt: skip
    kv_port: int = setting(0, "the KV transfer port (0: any free one)", "PORT", "--kv-port")
    lease_seconds: float = setting(
        30.0, "prefill: how long a finished prompt keeps its blocks for a decode side",
        "SECONDS", "--kv-lease-seconds",
    )  # fmt: skip
    on_failure: str = setting(
        "recompute", "decode: when a pull fails, recompute the prompt here or fail the "
        "request (recompute | fail)", "POLICY", "--kv-transfer-failure",
    )  # fmt: skip
    backend: str = setting(
        "auto", "auto (NIXL when the nixl package is installed, else ZeroMQ), zmq or nixl",
        "BACKEND", "--kv-backend",
    )  # fmt: skip
    secret: str | None = setting(
        None, "the secret shared by the router and every prefill and decode instance: it "
        "signs transfer parameters and authenticates KV reads (default: $TANDEM_KV_SECRET; "
        "required for the prefill and decode roles)", "SECRET", "--kv-secret",
    )  # fmt: skip
    max_leased_fraction: float = setting(
        0.5, "prefill: the most of the KV cache that finished prompts may hold for decode "
        "sides; past it a prompt's blocks are not kept (the decode side computes it)",
        "FRACTION", "--kv-max-leased-fraction",
    )  # fmt: skip

    def __post_init__(self) -> None:
        choices = {
            "role": KV_ROLES,
            "on_failure": ("recompute", "fail"),
            "backend": ("auto", "zmq", "nixl"),
        }
        if not 0 <= self.max_leased_fraction <= 1:
            raise InvalidParameterError(
                "kv_transfer_config.max_leased_fraction", "must be in [0, 1]"
            )
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InvalidParameterError(
                    f"kv_transfer_config.{name}",
                    f"{getattr(self, name)!r} is not one of {', '.join(allowed)}",
                )
        if self.lease_seconds <= 0:
            raise InvalidParameterError("kv_transfer_config.lease_seconds", "must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = setting(
        "auto", "auto (CPU: float32, CUDA: bfloat16), float32, bfloat16 or float16", "DTYPE"
    )
    device: str = setting("cpu", "cpu or cuda", "DEVICE")
    quantization: str = setting(
        "auto",
        "auto (a GGUF file's weights stay in its formats), none (all weights float in "
        "--dtype), or q8_0 / q4_0 / q4_k (quantize every linear layer on load)",
        "FORMAT",
    )
    seed: int = setting(0, "seed of the engine's shared random generator", "N")
    enforce_eager: bool = setting(
        False,
        "CUDA: run every step eagerly (decode and verification steps otherwise replay CUDA graphs)",
    )
    max_model_len: int | None = setting(None, "the context length (default: the model's)", "TOKENS")
    hf_overrides: str | None = setting(
        None,
        "JSON merged into the model's config.json at load (vLLM's --hf-overrides), e.g. "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true}\' for a Qwen3-Reranker',
        "JSON",
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.hf_overrides, dict):  # LLM(hf_overrides={...}): kept as JSON
            object.__setattr__(self, "hf_overrides", json.dumps(self.hf_overrides))
        if self.hf_overrides is not None:
            try:
                overrides = json.loads(self.hf_overrides)
            except (TypeError, json.JSONDecodeError) as exc:
                raise InvalidParameterError("hf_overrides", f"is not JSON: {exc}") from None
            if not isinstance(overrides, dict):
                raise InvalidParameterError("hf_overrides", "must be a JSON object")

    def config_overrides(self) -> dict[str, Any]:
        """hf_overrides as a dict (empty without them)."""
        return json.loads(self.hf_overrides) if self.hf_overrides is not None else {}

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        speculative = _section(kwargs.pop("speculative_config", None), SpeculativeConfig,
                               "speculative_config")  # fmt: skip
        kv_transfer = _section(kwargs.pop("kv_transfer_config", None), KVTransferConfig,
                               "kv_transfer_config")  # fmt: skip
        sections = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
        top = {f.name for f in dataclasses.fields(cls)} - set(sections)
        top -= {"model", "speculative", "kv_transfer"}
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
            kv_transfer=kv_transfer,
        )


def _section(value: Any, cls: type, name: str) -> Any:
    """A section given as a dict (``speculative_config={...}``) -> its dataclass."""
    if not isinstance(value, dict):
        return value
    unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise InvalidParameterError(name, f"unknown key(s): {', '.join(sorted(unknown))}")
    return cls(**value)
