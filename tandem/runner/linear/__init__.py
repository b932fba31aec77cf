"""Linear methods: how each Linear layer's weight is stored and multiplied.

    cpu_small_batch.py   CPU float32/bfloat16: the compiled kernel for decode-sized
                         batches (one pass over the weights), torch above that
    quantized.py         weights kept in llama.cpp's block formats (GGUF files,
                         quantize on load): the integer-dot kernel
    half_weights.py      float16 / bfloat16 matrices of a float32 model (GGUF F16 /
                         BF16), widened on the fly
    triton_blocks.py     CUDA: GGUF blocks (every format) widened inside a Triton matmul

``linear_method_for`` picks one per layer: quantized when the loader left the layer
quantized parts, else by device and dtype. The default,
``TorchLinearMethod``, lives beside ``Linear`` in tandem.models.linear.
"""

from __future__ import annotations

import torch

from tandem.models.linear import TORCH_LINEAR, Linear, LinearMethod
from tandem.models.quantized import packed_parts
from tandem.quant.split_blocks import block_parts
from tandem.runner.linear import cpu_small_batch
from tandem.runner.linear.half_weights import HalfWeightLinearMethod
from tandem.runner.linear.quantized import QuantizedLinearMethod
from tandem.runner.linear.triton_blocks import BlockLinearMethod

QUANTIZED_LINEAR = QuantizedLinearMethod()
HALF_WEIGHT_LINEAR = HalfWeightLinearMethod()
BLOCK_LINEAR = BlockLinearMethod()


def linear_method_for(layer: Linear, device: torch.device, dtype: torch.dtype) -> LinearMethod:
    if packed_parts(layer):
        return QUANTIZED_LINEAR
    if block_parts(layer):
        return BLOCK_LINEAR
    if getattr(layer, "half_weight", None) is not None:
        return HALF_WEIGHT_LINEAR
    if cpu_small_batch.supported(device, dtype):
        return cpu_small_batch.CpuSmallBatchLinearMethod(dtype)
    return TORCH_LINEAR
