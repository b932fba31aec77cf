"""``tandem plan``: will this model and context fit on that hardware, and how fast can it
be at best? Back-of-the-envelope numbers from the model's config.json alone.

    weights        params x bytes per weight (split over tensor-parallel ranks)
    KV per token   2 (K and V) x layers x KV heads x head dim x bytes per KV element;
                   a rank holds KV heads / tp of them (at least one: ranks beyond the
                   number of KV heads hold replicas)
    fits           (memory x utilization - weights per rank) / KV per token per rank
    prefill floor  2 x params x prompt tokens / FLOP/s            (compute-bound)
                   + the prompt's causal attention: 4 x layers x heads x head dim x
                   the (query, key) pairs it scores / the rate attention runs at
    decode floor   weight bytes / bandwidth + batch x context x KV per token / the
                   rate the decode attention kernel reads K/V (measured on this machine;
                   elsewhere the bandwidth): memory-bound, every step reads all weights
                   and every sequence's KV
    crossover      the batch where a decode step's compute (2 x params x batch / FLOP/s)
                   catches up with its memory time: above it, decode is compute-bound
    experts        a mixture of experts: params above are the active ones (a token's
                   top_k experts a layer), and a step reads the experts its batch
                   picked: E x (1 - (1 - k/E)^batch) a layer on average (plan/cost.py)

Floors ignore activations and kernel overheads; real systems reach a fraction of them
(``--measure`` shows which fraction tandem reaches here).

A GGUF file is priced as the engine runs it (``dtype="gguf"``): its weights at the bytes
each tensor takes in the kernels' packed layout (file_weights), a decode step reading
every matrix but the embedding's unread rows, prefill at the rate of the integer-dot
kernel that multiplies them (measured on this machine), and on this machine the KV
capacity the engine allocates by default (runner/kv_cache.py's budget, same blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.errors import InvalidParameterError
from tandem.models.config import ModelConfig
from tandem.models.dtypes import DTYPES
from tandem.models.loader import initializers_skipped, read_config
from tandem.plan.cost import (
    ModelShape,
    busiest_rank_experts,
    collective_seconds,
    expected_experts,
    expert_read_share,
)
from tandem.plan.hardware import Hardware
from tandem.quant.blocks import BLOCK, GGMLType

MEMORY_UTILIZATION = 0.9  # the share of device memory given to weights + KV cache


def read_model(path: str | Path) -> tuple[ModelConfig, int]:
    """A model folder or a config.json file -> (ModelConfig, parameter count). The model
    is built on the meta device, so no weights are needed and nothing is allocated (nor
    initialized: torch's first meta initializer takes seconds)."""
    _, config, cls = read_config(path)
    with torch.device("meta"), initializers_skipped():
        model = cls(config)
    return config, sum(p.numel() for p in model.parameters())


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: float, tp: int = 1
) -> float:
    """KV cache bytes one token takes on one tensor-parallel rank (ModelConfig's formula,
    for a shape given by hand)."""
    shape = ModelConfig(
        architecture="", vocab_size=0, hidden_size=0, num_layers=num_layers,
        num_heads=num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=0, max_position_embeddings=0, norm_eps=0.0, hidden_act="",
        tie_word_embeddings=False, rope=None,
    )  # fmt: skip
    return shape.kv_bytes_per_token(bytes_per_element, tp)


def prefill_seconds(params: int, num_tokens: int, tflops: float) -> float:
    return 2 * params * num_tokens / (tflops * 1e12)


def attended_pairs(length: int, window: int | None) -> int:
    """(query, key) pairs a causal prompt of ``length`` tokens scores: each token sees
    itself and the tokens before it, at most ``window`` of them."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def attention_flops(config: ModelConfig, prompt_len: int) -> float:
    """A prompt's attention FLOPs: per layer and query head, each attended pair's score
    (a dot of head_dim) and its weighted value (as many), 2 FLOPs a multiply-add. Small
    beside the matmuls' (a few % at 512 tokens) but run at the float rate, not the
    integer kernels' (on a CPU, a tenth of it): at 512 tokens of a 1B model, a fifth of
    a prefill's time."""
    per_pair = 4 * config.num_heads * config.head_dim
    return sum(per_pair * attended_pairs(prompt_len, w) for w in config.layer_windows())


def decode_step_seconds(
    weight_bytes: float, batch: int, context: float, kv_per_token: float, bandwidth_gbs: float,
    kv_bandwidth_gbs: float | None = None,
) -> float:  # fmt: skip
    """Weights at ``bandwidth_gbs``, the batch's K/V at ``kv_bandwidth_gbs`` (the rate
    the decode attention kernel reads them; the same unless measured)."""
    kv_rate = kv_bandwidth_gbs or bandwidth_gbs
    return weight_bytes / (bandwidth_gbs * 1e9) + batch * context * kv_per_token / (kv_rate * 1e9)


def crossover_batch(
    params: float, weight_bytes: float | Callable[[float], float], context: float,
    kv_per_token: float, tflops: float, bandwidth_gbs: float,
    kv_bandwidth_gbs: float | None = None,
) -> float | None:  # fmt: skip
    """Smallest batch whose decode step is compute-bound; None if KV reads grow at least
    as fast as compute (then decode never turns compute-bound). ``weight_bytes``: a
    step's weight reads, or a function of the batch (a mixture of experts reads more
    experts as the batch grows: the batch where both meet, found by iteration)."""
    compute_per_sequence = 2 * params / (tflops * 1e12)
    kv_time_per_sequence = context * kv_per_token / ((kv_bandwidth_gbs or bandwidth_gbs) * 1e9)
    if compute_per_sequence <= kv_time_per_sequence:
        return None
    per_sequence = compute_per_sequence - kv_time_per_sequence
    if not callable(weight_bytes):
        return weight_bytes / (bandwidth_gbs * 1e9) / per_sequence
    batch = 1.0
    for _ in range(100):  # reads grow with the batch and are bounded: this converges
        batch = weight_bytes(batch) / (bandwidth_gbs * 1e9) / per_sequence
    return batch


FILE_DTYPE = "gguf"  # a GGUF file's own formats, tensor by tensor


@dataclass(frozen=True)
class FileWeights:
    """A GGUF file's weights as the CPU engine holds and reads them."""

    held_bytes: int  # every tensor in its packed (or float) layout
    read_per_token: int  # what a batch-1 decode step reads: all but the embedding's rows
    # Per block format among what a step reads: (packed bytes, weights), for pricing
    # each at its own kernel's rates (this_machine).
    mix: dict[GGMLType, tuple[int, int]]
    # The [rows, columns] of each format's matrices in the first layer: the shapes its
    # kernel's prefill rate is measured on.
    layer_shapes: dict[GGMLType, list[tuple[int, int]]]
    layer_weights: int  # in the blocks' matrices: what each prompt token multiplies
    # Per block format, the blocks' weights in it: a prefill's formats (the LM head's,
    # often another, runs for one token of the prompt only).
    layer_mix: dict[GGMLType, int]
    head_weights: int  # the LM head's: run for the last prompt token only
    # A mixture's stacked experts (``*_exps``): their bytes in what a step could read,
    # and their weights in layer_weights (a token reads top_k / experts of both).
    expert_bytes: int = 0
    expert_weights: int = 0
    expert_block: int = 1  # the weights a block of theirs holds (their largest format's)

    def read_at(
        self, experts: int, per_token: int, tokens: float, ranks: int = 1, split: bool = False
    ) -> float:
        """A step of ``tokens`` tokens' weight reads: a mixture's (``experts``, of which
        ``per_token`` a token) only the experts they picked (cost.expert_read_share;
        ``split``: every rank holds its columns of every expert)."""
        if not experts:
            return self.read_per_token
        share = expert_read_share(experts, per_token, tokens, ranks, split)
        return self.read_per_token - self.expert_bytes * (1 - share)

    def active_layer_weights(self, experts: int, per_token: int) -> float:
        """The blocks' weights one token multiplies: a mixture's, its picked experts'."""
        if not experts:
            return self.layer_weights
        return self.layer_weights - self.expert_weights * (1 - per_token / experts)

    @property
    def main_format(self) -> GGMLType | None:
        """The block format with the most weights a step reads."""
        return max(self.mix, key=lambda code: self.mix[code][1]) if self.mix else None


def file_weights(path: Path) -> FileWeights:
    from tandem.models.gguf_split import open_gguf
    from tandem.quant.packed import packed_nbytes

    tensors = open_gguf(path).tensors
    names = {t.name for t in tensors}
    held = read = 0
    mix: dict[GGMLType, tuple[int, int]] = {}
    layer_shapes: dict[GGMLType, list[tuple[int, int]]] = {}
    layer_mix: dict[GGMLType, int] = {}
    layer_weights = head_weights = expert_bytes = expert_weights = 0
    expert_block = 1
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    for t in tensors:
        columns, rows = t.shape[0], math.prod(t.shape[1:])
        if t.type in BLOCK:
            code = GGMLType(t.type)
            size = packed_nbytes(code, rows, columns)
        elif t.type in (GGMLType.F16, GGMLType.BF16) and len(t.shape) > 1:
            size = rows * columns * 2  # kept at 2 bytes (half weights)
        else:
            size = rows * columns * 4  # float32: the CPU engine's dtype
        held += size
        if t.name.startswith("blk.") and len(t.shape) > 1:
            layer_weights += rows * columns
            if "_exps." in t.name:
                expert_bytes += size
                expert_weights += rows * columns
                if t.type in BLOCK:
                    expert_block = max(expert_block, BLOCK[t.type][0])
            if t.type in BLOCK:
                layer_mix[code] = layer_mix.get(code, 0) + rows * columns
        if t.name == head:
            head_weights = rows * columns
        # The embedding is read a row a token, unless it is also the LM head; Gemma 4's
        # per-layer table always a row.
        looked_up = t.name == "per_layer_token_embd.weight" or (
            t.name == "token_embd.weight" and "output.weight" in names
        )
        if not looked_up:
            read += size
            if t.type in BLOCK:
                nbytes, weights = mix.get(code, (0, 0))
                mix[code] = (nbytes + size, weights + rows * columns)
                if t.name.startswith("blk.0."):
                    layer_shapes.setdefault(code, []).append((rows, columns))
    return FileWeights(held, read, mix, layer_shapes, layer_weights, layer_mix, head_weights,
                       expert_bytes, expert_weights, expert_block)  # fmt: skip


def experts_block(model: str | Path) -> int:
    """The weights a block of a model's routed experts' tensors holds: a GGUF file's
    (their largest format's), 1 for a float checkpoint. With the expert intermediate
    size it decides whether tensor-parallel ranks split every expert (ModelShape)."""
    from tandem.models.catalog import resolve_model
    from tandem.models.gguf_checkpoint import find_gguf

    gguf = find_gguf(resolve_model(model))
    return file_weights(gguf).expert_block if gguf is not None else 1


def engine_cpu_kv_tokens(
    config: ModelConfig, weight_bytes: float, kv_dtype: str
) -> tuple[int, int]:
    """The KV tokens and the state slots (a hybrid's; else 0) the CPU engine allocates by
    default for this model (block size, max_num_seqs and max_model_len at their
    defaults): the same functions, with the memory available now less the weights it is
    about to load."""
    from tandem.config import CacheConfig, SchedulerConfig
    from tandem.runner.kv_cache import default_cpu_budget, host_available_bytes, num_blocks_for
    from tandem.runner.state_cache import split_budget

    block_size = CacheConfig().block_size
    max_num_seqs = SchedulerConfig().max_num_seqs
    available = host_available_bytes()
    budget = default_cpu_budget(None if available is None else max(0, available - weight_bytes))
    slots, budget = split_budget(config, max(budget, 1), max_num_seqs)
    blocks = num_blocks_for(
        config, block_size, torch.float32, torch.device("cpu"), None, max(budget, 1), 0.9,
        max_num_seqs, config.max_position_embeddings, engine_cache_dtype(kv_dtype),
    )  # fmt: skip
    return blocks * block_size, slots


# The plan's KV dtypes (short names) as the CPU engine's --kv-cache-dtype: fp32 is the
# "auto" cache of a float32 engine; the others name their own type.
_ENGINE_CACHE_DTYPES = {"fp32": "auto", "bf16": "bfloat16", "fp8": "fp8", "int8": "int8"}


def engine_cache_dtype(kv_dtype: str) -> str:
    """The CPU engine's --kv-cache-dtype for the plan's ``kv_dtype`` (a short name);
    InvalidParameterError for a type its cache cannot hold."""
    if kv_dtype not in _ENGINE_CACHE_DTYPES:
        raise InvalidParameterError(
            "kv_dtype", f"the CPU engine's cache holds {', '.join(_ENGINE_CACHE_DTYPES)}, "
            f"not {kv_dtype}",
        )  # fmt: skip
    return _ENGINE_CACHE_DTYPES[kv_dtype]


def engine_kv_dtype(dtype: str, on_cpu: bool) -> str:
    """The element type the engine's KV cache holds by default for weights in ``dtype``:
    the weights' own type when the engine computes in it (fp32, bf16, fp16), otherwise
    (block formats, fp8 and int8 weights) the type it computes in: fp32 on a CPU, bf16
    on a GPU. Never the weights' storage format: no cache is stored in q4_0."""
    entry = DTYPES.get(dtype)
    if entry is not None and entry.torch is not None:
        return entry.short
    return "fp32" if on_cpu else "bf16"


def gguf_path(model: str | Path) -> Path | None:
    from tandem.models.catalog import resolve_model
    from tandem.models.gguf_checkpoint import find_gguf

    return find_gguf(resolve_model(model))


def plan_arguments(
    model: str | Path, dtype: str, kv_dtype: str | None, prompt_len: int, output_len: int,
    batch: int, tp: int, engine_cpu: bool,
) -> tuple[str, str, Path | None]:  # fmt: skip
    """plan()'s arguments checked (InvalidParameterError naming the first bad one) and
    named as it uses them: (dtype, kv_dtype as short names, the GGUF file if the dtype
    is the file's). Cheap: callers check before measuring a machine."""
    kv_dtype = kv_dtype or engine_kv_dtype(dtype, on_cpu=engine_cpu)
    gguf = gguf_path(model) if dtype == FILE_DTYPE else None
    if dtype == FILE_DTYPE and gguf is None:
        raise InvalidParameterError(
            "dtype", f"{FILE_DTYPE!r} (the file's formats) needs a GGUF file"
        )
    for name, value in (("dtype", dtype), ("kv_dtype", kv_dtype)):
        if value not in DTYPES and not (name == "dtype" and gguf is not None):
            raise InvalidParameterError(name, f"{value!r} is not one of {list(DTYPES)}")
    dtype = FILE_DTYPE if gguf is not None else DTYPES[dtype].short
    kv_dtype = DTYPES[kv_dtype].short
    for name, value in (("prompt_len", prompt_len), ("output_len", output_len),
                        ("batch", batch), ("tp", tp)):  # fmt: skip
        if value < 1:
            raise InvalidParameterError(name, "must be >= 1")
    if engine_cpu and tp == 1:
        engine_cache_dtype(kv_dtype)
    return dtype, kv_dtype, gguf


def plan(
    model: str | Path,
    hardware: Hardware,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    prompt_len: int = 1024,
    output_len: int = 256,
    batch: int = 1,
    tp: int = 1,
    engine_cpu: bool = False,
    link: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """``engine_cpu``: the hardware is this machine, run by tandem's CPU engine: the KV
    capacity is the one it allocates by default (engine_cpu_kv_tokens). ``link``: the
    tensor-parallel ranks' link (GB/s each way, one all-reduce's latency in seconds;
    default: the hardware's), which every step's collectives cross."""
    dtype, kv_dtype, gguf = plan_arguments(
        model, dtype, kv_dtype, prompt_len, output_len, batch, tp, engine_cpu
    )
    config, params = read_model(model)
    if config.encoder:
        raise InvalidParameterError(
            "model", f"{config.architecture} is an encoder (embeddings, scores): the planner "
            "sizes models that generate"
        )  # fmt: skip
    computed = DTYPES[engine_kv_dtype(dtype, engine_cpu)].bytes
    weights = file_weights(gguf) if gguf is not None else None
    shape = ModelShape.of(config, params, 0, computed, weights.expert_block if weights else 1)
    active = shape.active_params  # a mixture: the weights one token multiplies
    split = shape.experts_split(tp)  # ranks split every expert, or each holds a run
    if weights is not None:
        weight_bytes = weights.held_bytes

        def read_at(tokens: float) -> float:
            return weights.read_at(shape.experts, shape.experts_per_token, tokens, tp, split)

        formats = weights.main_format.name if weights.main_format is not None else "float"
    else:
        weight_bytes = params * DTYPES[dtype].bytes

        def read_at(tokens: float) -> float:
            return weight_bytes * shape.read_share(tokens, tp)

        formats = dtype
    read_bytes = read_at(batch)
    kv_total = config.kv_bytes_per_token(DTYPES[kv_dtype].bytes)
    kv_rank = config.kv_bytes_per_token(DTYPES[kv_dtype].bytes, tp)
    tflops = hardware.flops_for(dtype) * tp
    bandwidth = hardware.bandwidth_gbs * tp
    kv_bandwidth = (hardware.kv_bandwidth_gbs or hardware.bandwidth_gbs) * tp
    weights_per_rank = weight_bytes / tp
    budget = hardware.memory_gb * 1e9 * MEMORY_UTILIZATION - weights_per_rank
    sequence = prompt_len + output_len
    # A hybrid's sequence also holds its recurrent layers' states (a fixed size).
    state = config.state_bytes_per_sequence()
    max_sequences = max(0, int(budget // (sequence * kv_rank + state)))
    max_tokens = max(0, int((budget - max_sequences * state) // kv_rank))
    if engine_cpu and tp == 1:
        max_tokens, slots = engine_cpu_kv_tokens(config, weight_bytes, kv_dtype)
        max_sequences = max_tokens // sequence
        if state:
            max_sequences = min(max_sequences, slots)
    # During decode a sequence's context grows from P to P + O: the mean is read per step.
    context = prompt_len + output_len / 2
    # Every rank reads its share of weights and KV; in aggregate that is all of them.
    kv_all_ranks = kv_rank * tp
    # (a hybrid's states are read once a step too, as the weights are)
    decode_memory = decode_step_seconds(
        read_bytes + batch * state, batch, context, kv_all_ranks, bandwidth, kv_bandwidth
    )
    decode_compute = 2 * active * batch / (tflops * 1e12)
    prefill = prefill_seconds(active, prompt_len, tflops)
    if gguf is not None:  # the file's own matrices: the head runs for one token
        layer_active = weights.active_layer_weights(shape.experts, shape.experts_per_token)
        flops = 2 * (layer_active * prompt_len + weights.head_weights)
        prefill = flops / (tflops * 1e12)
        decode_compute = 2 * (layer_active + weights.head_weights) * batch
        decode_compute /= tflops * 1e12
    # Attention runs in the type the engine computes in, whatever the weights' format.
    attention_tflops = hardware.attention_rate(engine_kv_dtype(dtype, engine_cpu)) * tp
    prefill_attention = attention_flops(config, prompt_len) / (attention_tflops * 1e12)
    prefill += prefill_attention
    link_gbs, latency_s = link or hardware.link()
    decode_collectives = collective_seconds(shape, batch, batch, tp, link_gbs, latency_s)
    prefill_collectives = collective_seconds(shape, prompt_len, 1, tp, link_gbs, latency_s)
    # The engine's own fixed cost of a step where measured (0 for a datasheet): a
    # prompt's step pays it once, as a decode step of one sequence does.
    step_overhead = hardware.step_overhead(batch)
    prefill_overhead = hardware.step_overhead(1)
    ttft = max(prefill, read_bytes / (bandwidth * 1e9)) + prefill_collectives + prefill_overhead
    tpot = max(decode_memory, decode_compute) + decode_collectives + step_overhead
    reads = read_at if shape.experts else read_bytes
    crossover = crossover_batch(
        active, reads, context, kv_all_ranks, tflops, bandwidth, kv_bandwidth
    )
    weights_only = crossover_batch(active, reads, 0, 0, tflops, bandwidth)
    result = {
        "model": str(model),
        "architecture": config.architecture,
        "hardware": hardware.name,
        "hardware_source": hardware.source,
        "tp": tp,
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        "parameters": params,
        "active_parameters": active,
        "experts": shape.experts,
        "experts_per_token": shape.experts_per_token,
        # Distinct experts a layer reads in a decode step of the batch (on average).
        "experts_read_per_step": expected_experts(shape.experts, shape.experts_per_token, batch)
        if shape.experts
        else 0.0,
        # Whether tensor-parallel ranks split every expert (else each holds a run).
        "experts_split": split,
        # Of those, what the busiest of the ranks reads: where the ranks hold runs of
        # whole experts, the most picks on one rank; split, its columns of every pick.
        "experts_read_busiest_rank": (
            busiest_rank_experts(shape.experts, shape.experts_per_token, batch, tp)
            if not split
            else expected_experts(shape.experts, shape.experts_per_token, batch)
        )
        if shape.experts
        else 0.0,
        "weight_formats": formats,
        "weight_bytes": weight_bytes,
        "weight_bytes_read_per_step": read_bytes,
        "weight_bytes_per_rank": weights_per_rank,
        "kv_bytes_per_token": kv_total,
        "kv_bytes_per_token_per_rank": kv_rank,
        "memory_bytes_per_rank": hardware.memory_gb * 1e9,
        "kv_capacity_source": "the engine's default KV budget here"
        if engine_cpu and tp == 1
        else f"{MEMORY_UTILIZATION:.0%} of memory",
        "weights_fit": budget > 0,
        "max_kv_tokens": max_tokens,
        "state_bytes_per_sequence": state,
        "max_sequences": max_sequences,
        "batch_fits": batch <= max_sequences,
        "context_limit": config.max_position_embeddings,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "batch": batch,
        "tflops": tflops,
        "attention_tflops": attention_tflops,
        "bandwidth_gbs": bandwidth,
        "kv_bandwidth_gbs": kv_bandwidth,
        "prefill_floor_s": prefill,
        "prefill_attention_s": prefill_attention,
        "decode_step_floor_s": decode_memory,
        "decode_step_compute_s": decode_compute,
        "step_overhead_s": step_overhead,
        "prefill_overhead_s": prefill_overhead,
        "crossover_batch": crossover,
        "crossover_batch_weights_only": weights_only,
        "ttft_estimate_s": ttft,
        "tpot_estimate_s": tpot,
        "tokens_per_s": batch / tpot,
        "link_gbs": link_gbs,
        "link_latency_s": latency_s,
        "decode_collectives_s": decode_collectives,
        "prefill_collectives_s": prefill_collectives,
    }
    if tp > 1:  # what the split buys: the same request on one device
        one = plan(model, hardware, dtype, kv_dtype, prompt_len, output_len, batch, 1,
                   engine_cpu, link)  # fmt: skip
        result["one_device"] = {k: one[k] for k in ("ttft_estimate_s", "tpot_estimate_s")}
    return result


def _bytes(value: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} bytes"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:,.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:,.2f} ms"
    return f"{value * 1e6:,.1f} us"


def _count(value: float) -> str:
    return f"{value / 1e9:,.2f} B" if value >= 1e9 else f"{value / 1e6:,.2f} M"


def _flops(tflops: float) -> str:
    """A FLOP rate with its digits: 0.0 TFLOP/s told nobody anything (a CPU's bf16)."""
    if tflops >= 10:
        return f"{tflops:,.0f} TFLOP/s"
    if tflops >= 1:
        return f"{tflops:,.2f} TFLOP/s"
    return f"{tflops * 1e3:,.3g} GFLOP/s"


def _batch(crossover: float | None) -> str:
    """A crossover as the smallest whole batch at or past it."""
    if crossover is None:
        return "never (KV reads grow as fast as compute)"
    if crossover <= 1:
        return "batch 1 (compute-bound at every batch)"
    return f"batch {math.ceil(crossover):,}"


def format_plan(result: dict[str, Any]) -> str:
    r = result
    fits = "yes" if r["weights_fit"] else "NO: the weights alone exceed the memory"
    lines = [
        f"model              {r['model']} ({r['architecture']})",
        f"hardware           {r['hardware']} x {r['tp']}  [{r['hardware_source']}]",
        f"                   {r['bandwidth_gbs']:,.0f} GB/s, {_flops(r['tflops'])} "
        f"({r['dtype']}), {_bytes(r['memory_bytes_per_rank'])} per device",
        "",
        f"parameters         {_count(r['parameters'])}"
        + (
            f" ({_count(r['active_parameters'])} active a token: {r['experts_per_token']} of "
            f"{r['experts']} experts a layer; a decode step of batch {r['batch']} reads "
            f"{r['experts_read_per_step']:.1f} of them on average)"
            if r["experts"]
            else ""
        ),
        f"weights ({r['weight_formats']})     {_bytes(r['weight_bytes'])} "
        f"({_bytes(r['weight_bytes_per_rank'])} per rank); fit: {fits}",
        f"KV per token       {r['kv_bytes_per_token']:,.0f} bytes in {r['kv_dtype']} "
        f"({r['kv_bytes_per_token_per_rank']:,.0f} per rank)",
        *(
            [
                f"state per sequence {_bytes(r['state_bytes_per_sequence'])} (a hybrid's "
                "recurrent layers, float32, whatever the context)"
            ]
            if r["state_bytes_per_sequence"]
            else []
        ),
        f"KV capacity        {r['max_kv_tokens']:,} tokens beside the weights (at "
        f"{r['kv_capacity_source']}) = {r['max_sequences']:,} sequences of "
        f"{r['prompt_len']} + {r['output_len']}; batch {r['batch']} "
        + ("fits" if r["batch_fits"] else "does NOT fit"),
        "",
        f"prefill floor      {_seconds(r['prefill_floor_s'])} for {r['prompt_len']} tokens "
        + (
            "(2 x (the layers' matrices x P + the LM head) / FLOP/s"
            if r["dtype"] == FILE_DTYPE
            else "(2 x active params x P / FLOP/s"
        )
        + f" + attention's FLOPs / {_flops(r['attention_tflops'])}: "
        f"{_seconds(r['prefill_attention_s'])})",
        f"decode step floor  {_seconds(r['decode_step_floor_s'])} at batch {r['batch']} "
        f"({_bytes(r['weight_bytes_read_per_step'])} of weights"
        + (" + batch x state" if r["state_bytes_per_sequence"] else "")
        + f" / bandwidth + batch x context x KV per token / {r['kv_bandwidth_gbs']:,.1f} GB/s)",
        f"decode compute     {_seconds(r['decode_step_compute_s'])} at batch {r['batch']} "
        "(2 x active params x batch / FLOP/s)",
        f"compute-bound at   {_batch(r['crossover_batch'])}; counting weight reads only: "
        f"{_batch(r['crossover_batch_weights_only'])}",
    ]
    if r["step_overhead_s"] or r["prefill_overhead_s"]:
        at_one = "" if r["batch"] == 1 else f", {_seconds(r['prefill_overhead_s'])} at batch 1"
        lines.append(
            f"engine fixed cost  {_seconds(r['step_overhead_s'])} a decode step at batch "
            f"{r['batch']}{at_one} (the host and each layer's calls, timed on a tiny model "
            "of this architecture; in the estimates below, not in the floors)"
        )
    if r["tp"] > 1:
        if r["experts"] and r["experts_split"]:
            lines.append(
                f"experts per rank   all {r['experts']}, 1/{r['tp']} of each one's columns: "
                f"every rank reads its share of the {r['experts_read_per_step']:.1f} experts "
                "a decode step's layer picks (--enable-expert-parallel: whole experts)"
            )
        elif r["experts"]:
            lines.append(
                f"experts per rank   {r['experts'] / r['tp']:g} each; a decode step's busiest "
                f"rank reads {r['experts_read_busiest_rank']:.1f} a layer (the mean rank "
                f"{r['experts_read_per_step'] / r['tp']:.1f}), and the others wait for it"
            )
        lines += [
            f"collectives        {_seconds(r['decode_collectives_s'])} a decode step, "
            f"{_seconds(r['prefill_collectives_s'])} a prefill (2 all-reduces a layer, each "
            f"{_seconds(r['link_latency_s'])} + 2 (N-1)/N x tokens x hidden / "
            f"{r['link_gbs']:,.0f} GB/s; the sampled logits gathered)",
        ]
        if "one_device" in r:
            one = r["one_device"]
            ttft = one["ttft_estimate_s"] / r["ttft_estimate_s"]
            tpot = one["tpot_estimate_s"] / r["tpot_estimate_s"]
            lines.append(
                f"TP {r['tp']} against 1     TTFT x{ttft:.2f}, TPOT x{tpot:.2f} as fast (below "
                "1: the collectives cost more than the split gains)"
            )
    lines += [
        "",
        f"TTFT estimate      {_seconds(r['ttft_estimate_s'])}",
        f"TPOT estimate      {_seconds(r['tpot_estimate_s'])}",
        f"throughput         {r['tokens_per_s']:,.0f} output tokens/s at batch {r['batch']}",
    ]
    if "calibrated" in r:
        c = r["calibrated"]
        lines += [
            "",
            f"step cost model fitted to {c['steps']} engine steps (saved to {c['file']}):",
            f"  {_seconds(c['step_overhead_s'])} + {_seconds(c['request_overhead_s'])} per "
            f"request + {_seconds(c['token_overhead_s'])} per token"
            f" + max(bytes / {c['bandwidth_gbs']:,.1f} GB/s, FLOPs / "
            f"{_flops(c['tflops'])}); error median {c['median_error']:.1%}, "
            f"max {c['max_error']:.1%}",
        ]
    if "measured" in r:
        m = r["measured"]
        lines += [
            "",
            "measured: tandem on this machine, this architecture with random weights",
            f"  prefill          {_seconds(m['prefill_s'])} = {m['prefill_of_floor']:.0%} "
            "of its floor",
            f"  decode step      {_seconds(m['decode_step_s'])} = {m['decode_of_floor']:.0%} "
            f"of its floor ({m['tokens_per_s']:,.0f} tokens/s)",
        ]
    return "\n".join(lines)
