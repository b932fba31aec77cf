"""Attention backends: where a layer's q, k, v meet the KV cache.

    metadata.py    who attends to what in one forward, built once on the host
    torch_sdpa.py  any device: index_copy_ writes, block gathers, SDPA
    triton_paged.py  CUDA: one Triton kernel over the flat batch, reading the blocks
    cpu_paged.py   CPU: compiled K/V write and paged decode kernel, SDPA for prompts
    causal.py      no cache (the recompute baseline, training)

A backend is a class built from (metadata, kv_cache) with ``attend(layer_idx, q, k, v,
scale)``, the ``AttentionContext`` models call; a backend whose kernel reads metadata
of its own shape names its builder as ``build_metadata`` (else
``build_paged_metadata``). ``paged_backend`` picks one by device, model dtype and the
cache's element type; each registers in ``BACKENDS`` with its ``supported`` test.
Backends run in order; the first supported wins.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tandem.runner.attention import cpu_paged, triton_paged
from tandem.runner.attention.causal import CausalAttention
from tandem.runner.attention.metadata import PagedAttentionMetadata, build_paged_metadata
from tandem.runner.attention.torch_sdpa import TorchPagedAttention

Supported = Callable[[torch.device, torch.dtype, torch.dtype], bool]
# name -> (backend class, whether it runs on (device, model dtype, cache element type))
BACKENDS: dict[str, tuple[type, Supported]] = {
    "cpu-paged": (
        cpu_paged.CpuPagedAttention,
        lambda device, dtype, kv: cpu_paged.supported(device, dtype),
    ),
    "triton-paged": (
        triton_paged.TritonPagedAttention,
        lambda device, dtype, kv: triton_paged.supported(device, dtype),
    ),
    "torch-sdpa": (TorchPagedAttention, lambda device, dtype, kv: True),
}


def paged_backend(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> type:
    """The first backend that runs on ``device``, ``dtype`` and a cache of ``kv_dtype``
    elements (TANDEM_ATTENTION names one explicitly, for comparisons)."""
    forced = os.environ.get("TANDEM_ATTENTION")
    if forced:
        return BACKENDS[forced][0]
    return next(cls for cls, supported in BACKENDS.values() if supported(device, dtype, kv_dtype))


__all__ = [
    "BACKENDS",
    "CausalAttention",
    "PagedAttentionMetadata",
    "TorchPagedAttention",
    "build_paged_metadata",
    "paged_backend",
]
