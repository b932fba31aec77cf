"""Host values onto the device without waiting for it.

A copy from ordinary (pageable) host memory to a CUDA GPU is synchronous in PyTorch:
the host waits for every kernel queued before it, so a step that makes a small index
tensor after launching its forward pass stalls until the forward is done, and the GPU
then idles while the host launches what follows. From pinned memory the copy is queued
like a kernel (PyTorch keeps the pinned block until the copy has run)."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a list, nested lists, or a CPU tensor) as a tensor on ``device``,
    queued behind the work already there on CUDA; a plain tensor elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        if isinstance(values, torch.Tensor):
            return values.to(device, dtype)
        return torch.tensor(values, dtype=dtype, device=device)
    if isinstance(values, torch.Tensor):
        host = values.to(dtype) if dtype is not None else values
        host = host.pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)
