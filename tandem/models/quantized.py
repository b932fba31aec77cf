"""Where quantized weights sit in a model: on Linear layers and in the embedding.

(And where float16 / bfloat16 matrices of a float32 model sit: ``half_weight``.)

The loader puts a checkpoint's quantized matrices (GGUF blocks, or weights quantized
on load) on the layers as ``PackedWeight`` parts, one per checkpoint tensor (q, k and
v are three parts of the fused qkv layer, possibly in different formats), and frees
the float weight. The runner's quantized linear method (runner/linear/quantized.py)
multiplies them; the model files never know.

The token embedding stays quantized too: ``QuantizedEmbedding`` dequantizes only the
rows it looks up. With tied embeddings the LM head shares the same PackedWeight.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.linear import Linear
from tandem.quant.packed import PackedWeight


def set_packed_part(layer: Linear, row_start: int, weight: PackedWeight) -> None:
    """Give ``layer`` rows [row_start, row_start + weight.rows) as ``weight``."""
    parts: list[tuple[int, PackedWeight]] = getattr(layer, "packed_parts", [])
    parts.append((row_start, weight))
    layer.packed_parts = sorted(parts, key=lambda part: part[0])


def packed_parts(layer: nn.Module) -> list[tuple[int, PackedWeight]]:
    return getattr(layer, "packed_parts", [])


def set_half_weight_part(layer: Linear, row_start: int, weight: torch.Tensor) -> None:
    """Rows [row_start, row_start + len(weight)) of ``layer``, kept in float16 /
    bfloat16 (a GGUF file's F16 / BF16 matrices on a float32 model)."""
    if getattr(layer, "half_weight", None) is None:
        layer.half_weight = weight.new_empty(layer.out_features, layer.in_features)
    layer.half_weight[row_start : row_start + weight.shape[0]] = weight


def drop_float_weight(layer: Linear) -> None:
    """The quantized parts replace the weight: keep an empty tensor of its dtype so
    the module still has ``weight`` (and ``.dtype``), without its memory."""
    weight = layer.weight
    layer.weight = nn.Parameter(
        torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False
    )


class QuantizedEmbedding(nn.Module):
    """nn.Embedding over a quantized table; looked-up rows come out in ``dtype``."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.packed.dequantize_rows(flat).to(self.dtype).reshape(*ids.shape, -1)


def quantize_linear_layers(model: nn.Module, fmt: str, device: torch.device) -> int:
    """Quantize every Linear layer's float weight into ``fmt`` (q8_0, q4_0, q4_k) and
    free it; returns how many layers were quantized. A layer whose input size is not
    whole blocks of the format stays float."""
    from tandem.errors import ModelLoadError
    from tandem.quant.blocks import BLOCK
    from tandem.quant.quantize import FORMATS, quantize

    if device.type != "cpu":
        raise ModelLoadError(f"quantization {fmt} runs on the CPU only (device is {device})")
    code = FORMATS[fmt]
    count = 0
    for module in model.modules():
        if not isinstance(module, Linear) or packed_parts(module):
            continue
        weight = module.weight.detach()
        if weight.shape[1] % BLOCK[code][0]:
            continue
        packed = PackedWeight.from_ggml(code, quantize(weight, code), weight.shape[1])
        set_packed_part(module, 0, packed)
        drop_float_weight(module)
        count += 1
    return count


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attribute, module)
