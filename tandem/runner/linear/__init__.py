"""Linear methods: how each Linear layer's weight is stored and multiplied.

    cpu_small_batch.py   CPU float32/bfloat16: the compiled kernel for decode-sized
                         batches (one pass over the weights), torch above that

``linear_method_for`` picks one by device and dtype; quantized formats (weights kept
quantized, integer-dot kernels) add a method here and a branch there. The default,
``TorchLinearMethod``, lives beside ``Linear`` in tandem.models.linear.
"""

from __future__ import annotations

import torch

from tandem.models.linear import TORCH_LINEAR, LinearMethod
from tandem.runner.linear import cpu_small_batch


def linear_method_for(device: torch.device, dtype: torch.dtype) -> LinearMethod:
    if cpu_small_batch.supported(device, dtype):
        return cpu_small_batch.CpuSmallBatchLinearMethod(dtype)
    return TORCH_LINEAR
