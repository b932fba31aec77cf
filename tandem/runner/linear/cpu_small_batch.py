"""Unquantized linear layers on the CPU: a compiled kernel for decode-sized batches.

A decode step multiplies a few activation rows by every weight matrix, so its time is
one pass over the weights; torch's BLAS path for that shape reaches about a third of
the memory bandwidth. The kernel (``small_linear`` in tandem/kernels/cpu_ops.cpp)
streams each weight once, four rows at a time, dotting them with every activation
row while they sit in L1, threads taking disjoint row ranges.

It only pays while the batch is small: each further row costs FMAs that BLAS's
blocked GEMM does better. ``python -m benchmarks.cpu_kernels`` measures both on the
machine at hand (on the 2-core EPYCs of the lab notes the kernel leads at one row and
torch from about 16). Above ``MAX_ROWS`` the layer goes to torch; a CPU with other
vector units may move the crossover, which that benchmark shows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import cpu as cpu_kernels
from tandem.models.linear import Linear

# Rows (tokens) up to which the kernel beats torch; from the measurement above.
MAX_ROWS = {torch.float32: 4, torch.bfloat16: 2}


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    return cpu_kernels.available(device, dtype) and dtype in MAX_ROWS


class CpuSmallBatchLinearMethod:
    def __init__(self, dtype: torch.dtype) -> None:
        self.max_rows = MAX_ROWS[dtype]

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass  # the kernel reads the checkpoint layout [out, in] as it is

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > self.max_rows or torch.is_grad_enabled():
            return F.linear(x, layer.weight, layer.bias)
        out = x.new_empty(x.shape[0], layer.out_features)
        cpu_kernels.load().small_linear(out, x, layer.weight, layer.bias)
        return out
