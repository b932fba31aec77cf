"""The paged KV cache memory: one tensor for all layers.

Layout ``[kv_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``: a
block is ``block_size`` consecutive token slots, and slot ``b * block_size + i`` is
token ``i`` of block ``b`` in every layer. One allocation keeps the cache easy to size
from a memory budget and to hand to a transfer engine as a single region.

``kv_cache_dtype="int8"`` stores each (token, KV head) row as ``head_dim`` int8 values
and their float32 scale (max|x| / 127), in a uint8 tensor whose last dimension is
``head_dim + 4``: a quarter of float32's bytes (plus 4 a row), and still one region
whose blocks move as they are. The CPU kernels (tandem/kernels/cpu_ops.cpp) read and
write that layout; ``quantize_kv_rows`` / ``dequantize_kv_rows`` are the same in torch
(the prompt path's gathers, and any device without the kernels).

``kv_cache_dtype="bfloat16"`` / ``"fp8"`` store rows in that type whatever the model
computes in (a float32 model's cache at half or a quarter of its bytes); values are
rounded on write and widened on read. fp8 is e4m3 (3 mantissa bits, as vLLM's
``fp8_e4m3``) without per-tensor scales: values beyond its +-448 range saturate.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

from tandem.config import DEFAULT_CPU_KV_CACHE_BYTES
from tandem.errors import InvalidParameterError
from tandem.models.config import ModelConfig

# The element types a cache may store instead of the model's (int8 is its own layout).
STORED_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
SCALE_BYTES = 4  # an int8 row's float32 scale
FP8_MAX = 448.0  # the largest finite e4m3fn value


def cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows in the cache's element type (fp8 saturating, not NaN, past its range)."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    if kv_cache_dtype == "int8":
        return int(config.kv_bytes_per_token(1, row_extra_bytes=SCALE_BYTES)) * block_size
    per_element = torch.empty((), dtype=STORED_DTYPES.get(kv_cache_dtype, dtype)).element_size()
    return int(config.kv_bytes_per_token(per_element)) * block_size


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    shared_file: str | None = None,
) -> torch.Tensor | LayeredKVCache:
    """The cache: one tensor when every layer's K/V rows have one shape; otherwise
    (Gemma 4's) a LayeredKVCache, each layer its own shape in one region."""
    row_extra = SCALE_BYTES if kv_cache_dtype == "int8" else 0
    if kv_cache_dtype == "int8":
        dtype = torch.uint8
    dtype = STORED_DTYPES.get(kv_cache_dtype, dtype)
    shapes = config.cache_shapes()
    if len(set(shapes)) > 1:
        if shared_file is not None:
            raise ValueError("a cache of layers of several shapes is not shared between ranks")
        per_layer = [(2, num_blocks, block_size, h, d + row_extra) for h, d in shapes]
        total = sum(math.prod(shape) for shape in per_layer)
        if device.type == "cpu":
            flat = zeroed_on_first_touch((total,), dtype)
        else:
            flat = torch.zeros(total, dtype=dtype, device=device)
        return LayeredKVCache(flat, per_layer)
    heads, head_dim = shapes[0] if shapes else (config.num_kv_heads, config.head_dim)
    shape = (len(shapes), 2, num_blocks, block_size, heads, head_dim + row_extra)
    if device.type == "cpu" and math.prod(shape):
        return zeroed_on_first_touch(shape, dtype, shared_file)
    return torch.zeros(shape, dtype=dtype, device=device)


class LayeredKVCache:
    """The paged cache of a model whose layers' K/V rows differ in shape (Gemma 4: its
    full-attention layers' heads are larger and fewer): ``cache[i]`` is cache place i's
    ``[2 (K, V), num_blocks, block_size, heads_i, head_dim_i]``, each a contiguous view
    of one region, so attention reads a layer as it reads one of a single tensor's.
    A block is still slot ``b * block_size + i`` in every layer. ``read``/``write``
    move blocks as the KV transfer agents do (disagg/transfer.py), each block every
    layer's rows flattened: ``[1, 2, n, elements of a block in every layer]``."""

    def __init__(self, flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> None:
        self.flat = flat
        self.layers: list[torch.Tensor] = []
        start = 0
        for shape in shapes:
            size = math.prod(shape)
            self.layers.append(flat[start : start + size].view(shape))
            start += size
        self.dtype, self.device = flat.dtype, flat.device
        num_blocks = shapes[0][1]
        self.block_elements = [math.prod(shape[2:]) for shape in shapes]
        self.shape = (1, 2, num_blocks, sum(self.block_elements))

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.layers[index]

    def read(self, block_ids: torch.Tensor) -> torch.Tensor:
        parts = [layer[:, block_ids].flatten(2) for layer in self.layers]
        return torch.cat(parts, dim=2).unsqueeze(0)

    def write(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        parts = blocks[0].split(self.block_elements, dim=2)
        for layer, part in zip(self.layers, parts, strict=True):
            layer[:, block_ids] = part.reshape(2, len(block_ids), *layer.shape[2:])


def zeroed_on_first_touch(
    shape: tuple[int, ...], dtype: torch.dtype, shared_file: str | None = None
) -> torch.Tensor:
    """A zero CPU tensor whose pages the OS provides as they are first written (an
    anonymous mapping, page-aligned): a 2 GiB cache of which a few blocks are used
    costs those blocks' memory, not 2 GiB of resident memory (torch.zeros writes
    every page up front). ``shared_file``: a new file in shared memory (/dev/shm)
    instead, which another process on the host can map (``map_shared``)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if shared_file is None:
        region = mmap.mmap(-1, max(nbytes, 1))
    else:
        fd = os.open(shared_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            region = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def map_shared(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Another process's ``shared_file`` cache, mapped here (writes are seen there)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR)
    try:
        region = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] -> uint8 [..., head_dim + 4]: int8 values, then the float32 scale."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / torch.where(scale > 0, scale, 1), 0)
    q = torch.round(xf * inverse).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., head_dim + 4] -> [..., head_dim] in ``dtype``."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    q = rows[..., :head_dim].contiguous().view(torch.int8).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (q * scale).to(dtype)


def as_cached(x: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
    """K or V rows as a read from a cache of element type ``stored`` returns them (uint8:
    the int8 rows with their scales), in x's dtype. Prompts attended over their own K/V
    see these values, as their later chunks and decodes will: a token's result does not
    depend on whether its context came from this forward or from the cache."""
    if stored == x.dtype:
        return x
    if stored == torch.uint8:
        return dequantize_kv_rows(quantize_kv_rows(x), x.dtype)
    return cache_rows(x, stored).to(x.dtype)


DEFAULT_CPU_AVAILABLE_FRACTION = 0.8


def num_blocks_for(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    max_num_seqs: int,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
) -> int:
    """Blocks in the pool: ``num_blocks`` if given, else what the memory budget holds:
    ``kv_cache_memory`` bytes; on CUDA the part of ``gpu_memory_utilization`` x total
    memory still free after the weights; on CPU 2 GiB, or 80% of the memory still
    available after the weights when that is less. A budget is never spent on more
    blocks than ``max_num_seqs`` sequences of ``max_model_len`` tokens can use (each
    in whole blocks: capping at their tokens / block size left a full batch of
    full-length sequences a few blocks short, and one of them preempted). On a CPU,
    a pool that the host's available memory cannot hold is refused here, at start
    (InvalidParameterError naming the setting), not met later by the OOM killer."""
    per_block = kv_bytes_per_block(config, block_size, dtype, kv_cache_dtype)
    available = host_available_bytes() if device.type == "cpu" else None
    setting = "num_blocks" if num_blocks is not None else "kv_cache_memory"
    if num_blocks is None:
        budget = cache_budget(device, kv_cache_memory, gpu_memory_utilization, available)
        useful = max_num_seqs * -(-max_model_len // block_size)
        # (an encoder's blocks cost nothing: they only count a batch's tokens)
        num_blocks = max(1, min(int(budget // per_block) if per_block else useful, useful))
    if available is not None and num_blocks * per_block > available:
        raise InvalidParameterError(
            setting,
            f"a KV cache of {num_blocks * per_block / (1 << 30):.2f} GiB ({num_blocks} blocks) "
            f"does not fit: {available / (1 << 30):.2f} GiB of memory is available after "
            "loading the model",
        )
    return num_blocks


def cache_budget(
    device: torch.device,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    available: int | None = None,
) -> float:
    """The cache's memory budget in bytes: ``kv_cache_memory`` if given; on CUDA the part
    of ``gpu_memory_utilization`` x total memory still free after the weights; on CPU
    ``default_cpu_budget`` of the ``available`` memory."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free - (1 - gpu_memory_utilization) * total
    return default_cpu_budget(available)


def default_cpu_budget(available: int | None) -> int:
    """The CPU KV cache's budget when none is given: 2 GiB, or 80% of the memory
    available (after the weights) when that is less."""
    if available is None:
        return DEFAULT_CPU_KV_CACHE_BYTES
    return min(DEFAULT_CPU_KV_CACHE_BYTES, int(available * DEFAULT_CPU_AVAILABLE_FRACTION))


def host_available_bytes() -> int | None:
    """The kernel's estimate of memory available to a new allocation without swapping
    (MemAvailable), None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
