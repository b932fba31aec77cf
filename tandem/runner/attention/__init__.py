"""Attention backends: where a layer's q, k, v meet the KV cache.

    metadata.py    who attends to what in one forward, built once on the host
    torch_sdpa.py  any device: index_copy_ writes, block gathers, SDPA
    cpu_paged.py   CPU: compiled K/V write and paged decode kernel, SDPA for prompts
    causal.py      no cache (the recompute baseline, training)

A backend is a class built from (metadata, kv_cache) with ``attend(layer_idx, q, k, v,
scale)``, the ``AttentionContext`` models call. ``paged_backend`` picks one by device
and dtype; a CUDA backend (FlashAttention, Triton) registers in ``BACKENDS`` with its
``supported`` test. Backends run in order; the first supported wins.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tandem.runner.attention import cpu_paged
from tandem.runner.attention.causal import CausalAttention
from tandem.runner.attention.metadata import PagedAttentionMetadata, build_paged_metadata
from tandem.runner.attention.torch_sdpa import TorchPagedAttention

# name -> (backend class, whether it runs on (device, dtype))
BACKENDS: dict[str, tuple[type, Callable[[torch.device, torch.dtype], bool]]] = {
    "cpu-paged": (cpu_paged.CpuPagedAttention, cpu_paged.supported),
    "torch-sdpa": (TorchPagedAttention, lambda device, dtype: True),
}


def paged_backend(device: torch.device, dtype: torch.dtype) -> type:
    """The first backend that runs on ``device`` and ``dtype`` (TANDEM_ATTENTION names
    one explicitly, for comparisons)."""
    forced = os.environ.get("TANDEM_ATTENTION")
    if forced:
        return BACKENDS[forced][0]
    return next(cls for cls, supported in BACKENDS.values() if supported(device, dtype))


__all__ = [
    "BACKENDS",
    "CausalAttention",
    "PagedAttentionMetadata",
    "TorchPagedAttention",
    "build_paged_metadata",
    "paged_backend",
]
