"""Triton, imported only where it can run: on a machine with a CUDA device (CUDA
builds of torch bundle it) or under its CPU interpreter (TRITON_INTERPRET=1, how the
GPU kernels are rehearsed without a GPU). A CPU process never imports it: importing
it kept 73 MB resident (its compiler library's pages) in a process that could not use
it, 1.6% of an 8B Q4_0 file's bytes.

The GPU modules (kernels/cuda.py, runner/attention/triton_paged.py,
runner/linear/triton_blocks.py) take ``triton`` and ``tl`` from here; both are None
where Triton is absent or cannot run, and those modules then define no kernels."""

from __future__ import annotations

import os

import torch


def _import():
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        return None, None
    try:
        import triton
        import triton.language as tl
    except ImportError:  # CPU-only builds of torch do not bundle it
        return None, None
    return triton, tl


triton, tl = _import()
