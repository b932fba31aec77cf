"""A whole decoder layer in one compiled call, for steps that only decode.

At batch 1 on a small model the Python between a layer's compiled calls (module calls,
views, dispatch: ~100 us a layer on 2 cores) costs as much as its matmuls.
``llama_decode_layer`` (kernels/decode_layer.cpp) makes the same calls, in the same
order, from C++: outputs equal the layer-by-layer path bit for bit.

It applies when every token of the step is a decode and they are one contiguous run
(the scheduler puts decodes first), and the layer is the plain Llama shape on the CPU
kernels: float32, rotary on the kernel path, silu MLP, no q/k norm, no biases, and
each linear layer one packed quantized matrix (runner/linear/quantized.py). Anything
else runs layer by layer. The attention backend offers it to the model as
``attn.decode_layer``; the model file only asks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.runner.linear.quantized import QuantizedLinearMethod

if TYPE_CHECKING:
    from tandem.runner.attention.torch_sdpa import TorchPagedAttention


def _packed(linear) -> tuple | None:
    parts = getattr(linear, "packed_parts", None)
    if not isinstance(linear.method, QuantizedLinearMethod) or not parts or len(parts) != 1:
        return None
    if linear.bias is not None:
        return None
    w = parts[0][1]
    corr = w.corr if w.corr is not None else w.scales.new_empty(0)
    return (w.values, w.scales, corr, w.rows, w.group, w.offset)


def layer_arguments(layer) -> tuple | None:
    """The layer's fixed arguments, or None when it is not the plain shape (cached on
    the layer after the first look)."""
    cached = getattr(layer, "_fused_decode", False)
    if cached is not False:
        return cached
    args = None
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    plain = (
        attn is not None and mlp is not None and not getattr(attn, "qk_norm", True)
        and getattr(mlp, "fused_silu", False)
        and layer.input_layernorm.weight.dtype == torch.float32
    )  # fmt: skip
    if plain:
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        packed = [_packed(linear) for linear in linears]
        if all(p is not None for p in packed):
            args = (
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                layer.input_layernorm.eps, *packed,
                attn.num_heads, attn.num_kv_heads, attn.head_dim,
            )  # fmt: skip
    layer._fused_decode = args
    return args


class FusedDecode:
    """``attn.decode_layer`` of a decode-only step: ``(layer, h, residual, rope) ->
    (h, residual)``, or None when the layer must run its own way."""

    def __init__(self, backend: TorchPagedAttention) -> None:
        self.backend = backend
        group = backend.metadata.groups[0]
        self.block_tables = group.block_tables
        self.context_lens = group.context_lens

    @staticmethod
    def applies(backend: TorchPagedAttention) -> bool:
        metadata = backend.metadata
        if metadata.fresh_prompts or len(metadata.groups) != 1:
            return False
        group = metadata.groups[0]
        return group.query_index.shape[1] == 1 and group.contiguous_from == 0

    def __call__(self, layer, h, residual, rope):
        args = layer_arguments(layer)
        if args is None or rope.cos is not None or h.dtype != torch.float32 or h.dim() != 2:
            return None
        layer_idx = layer.self_attn.layer_idx
        k_blocks, v_blocks = self.backend.kv_cache[layer_idx]
        window = self.backend.metadata.window(layer_idx) or 0
        norm1, norm2, eps, qkv, o_proj, gate_up, down, heads, kv_heads, head_dim = args
        empty = h.new_empty(0)
        out, residual = cpu_kernels.load().llama_decode_layer(
            h, empty if residual is None else residual, norm1, norm2, eps, qkv, o_proj,
            gate_up, down, heads, kv_heads, head_dim, rope.positions, rope.cos_sin,
            k_blocks, v_blocks, self.backend.metadata.slot_mapping, self.block_tables,
            self.context_lens, layer.self_attn.scale, window,
        )  # fmt: skip
        return out, residual
