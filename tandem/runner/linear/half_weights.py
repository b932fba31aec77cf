"""float16 / bfloat16 matrices of a float32 model, kept at 2 bytes a weight.

A GGUF file's F16 (or BF16) matrices: widening them to float32 at load doubles the
bytes every decode step streams. The loader keeps them as ``half_weight`` instead
(models/quantized.py); decode-sized batches run the small-batch kernel, which widens
16 weights at a time in registers (F16C / AVX-512 conversions); larger batches widen
the matrix once per call for torch's matmul, where compute, not bytes, is the cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import cpu as cpu_kernels
from tandem.models.linear import Linear

# Tokens up to which streaming the 2-byte weights beats widening them per call for
# torch: at 16 (125M Llama F16, 2-core EPYC) 88 ms a step against 133.
MAX_ROWS = 32


class HalfWeightLinearMethod:
    def process_weights_after_loading(self, layer: Linear) -> None:
        pass  # the loader left layer.half_weight [out, in] in float16 / bfloat16

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        weight = layer.half_weight
        use_kernel = (
            x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32
            and x.stride(1) == 1 and not torch.is_grad_enabled()
        )  # fmt: skip
        if not use_kernel:
            return F.linear(x, weight.to(x.dtype), layer.bias)
        out = x.new_empty(x.shape[0], weight.shape[0])
        cpu_kernels.load().small_linear(out, x, weight, layer.bias)
        return out
