"""A whole decoder layer in one compiled call, for steps that only decode.

At batch 1 on a small model the Python between a layer's compiled calls (module calls,
views, dispatch) costs as much as its matmuls.
``llama_decode_layer`` (kernels/decode_layer.cpp) makes the same calls, in the same
order, from C++: outputs equal the layer-by-layer path bit for bit.

It applies when every token of the step is a decode, or a decode with its draft tokens
(speculative verification: a few query rows per sequence, up to ``ROWS_MAX``), and
they are the step's tokens in order, and the layer is a shape the kernel knows on the
CPU kernels: float32, rotary on the kernel path, a silu or GELU-tanh gated MLP, no
biases but q/k/v's (Qwen2's), each linear layer one packed quantized matrix
(runner/linear/quantized.py); q/k norms (Qwen3, Gemma 3) and Gemma's norms after
attention and MLP are optional parts. A mixture-of-experts layer runs whole in one
call too (attention, the router, the experts: kernels/moe_ops.cpp) where it has no
shared expert and a float32 router; otherwise its attention half compiled, then the
mixture's own forward, whose experts take their own kernel call
(runner/linear/experts.py; on a tensor-parallel rank, the experts it holds,
all-reduced by the mixture). On a tensor-parallel rank the layer runs as two compiled
halves, each ending in the rank's partial sums of a row-parallel projection (o, down),
all-reduced between them as the layer-by-layer path does. Anything else runs layer by
layer. The attention backend offers it to the model as ``attn.decode_layer``; the
model file only asks.

Where every layer of the model runs whole in one process (dense, or a mixture's whole
layer), the step goes further: ``attn.decode_stack`` runs all of them in one call
(kernels/decode_stack.cpp), the same per-layer calls made from C++ with the stream
passed along, so the Python between layers is gone too. So does a tensor-parallel rank
whose ranks meet in one host's shared memory (runner/shm_group.py), its layers dense
or mixtures that run whole: its halves and the all-reduces between them run in one
call (``llama_decode_stack_ranked``), which hands a long wait back to the group so
that a dead or hung rank is still found. TANDEM_FUSED_DECODE=layers keeps the
per-layer calls (for comparisons), 0 turns both off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.models.layers import gelu_tanh_and_mul, silu_and_mul
from tandem.models.moe import SparseMoE
from tandem.runner.linear.parallel import RowParallelLinearMethod
from tandem.runner.linear.quantized import QuantizedLinearMethod
from tandem.runner.shm_group import ShmGroup

EXPERTS = "experts"  # in place of a layer's gate/up and down: a mixture's own kernel

if TYPE_CHECKING:
    from tandem.runner.attention.torch_sdpa import TorchPagedAttention


def _packed(linear) -> list[tuple] | None:
    """The linear layer's packed parts as the kernel takes them, or None when it is
    not all packed quantized weights (a row-parallel layer's: its rank's part, the
    all-reduce left to the caller). Its bias is the caller's to check."""
    parts = getattr(linear, "packed_parts", None)
    method = linear.method
    if isinstance(method, RowParallelLinearMethod):
        method = method.inner
    if not isinstance(method, QuantizedLinearMethod) or not parts:
        return None
    return [
        (start, w.values, w.scales, w.corr if w.corr is not None else w.scales.new_empty(0),
         w.rows, w.group, w.offset, w.factor, w.table)
        for start, w in parts
    ]  # fmt: skip


def _bias(linear) -> torch.Tensor:
    """The bias as the kernel adds it (float32, contiguous, as QuantizedLinearMethod
    passes it), or empty: none, or one the kernel cannot take."""
    bias = getattr(linear, "float_bias", linear.bias)
    if bias is None or bias.dtype != torch.float32 or not bias.is_contiguous():
        return torch.empty(0)
    return bias


def _norm_args(layer) -> tuple[torch.Tensor, ...] | None:
    """The layer's norms' multipliers in the kernel's order (``layer.norms()``; empty
    where it has none: the kernel's optional parts), or None when one is not float32."""
    norms = getattr(layer, "norms", None)
    if norms is None:
        return None
    args = tuple(n.multiplier() if n is not None else torch.empty(0) for n in norms())
    if any(a.numel() and a.dtype != torch.float32 for a in args):
        return None
    return args


def layer_arguments(layer) -> tuple | None:
    """The layer's fixed arguments, or None when it is not a shape the kernel runs
    (cached on the layer after the first look)."""
    cached = getattr(layer, "_fused_decode", False)
    if cached is not False:
        return cached
    args = None
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    # A mixture's layer: its experts run their own kernel (runner/linear/experts.py)
    # after the compiled attention half; no gate/up, down or activation here.
    experts = isinstance(mlp, SparseMoE) and hasattr(mlp, "fused_experts")
    act = None if experts else getattr(mlp, "act_and_mul", None)
    if act not in (silu_and_mul, gelu_tanh_and_mul):  # (the kernel's two activations)
        act = None
    # (attention sinks, gpt-oss's, are not in the kernel)
    ready = (
        attn is not None and getattr(attn, "sinks", None) is None and (act is not None or experts)
    )
    norms = _norm_args(layer) if ready else None
    if norms is not None:
        unbiased = [attn.o_proj] + ([] if experts else [mlp.gate_up_proj, mlp.down_proj])
        packed = [_packed(linear) for linear in [attn.qkv_proj, *unbiased]]
        qkv_bias = _bias(attn.qkv_proj)  # the only bias the kernel takes (Qwen2's)
        biases_fit = all(linear.bias is None for linear in unbiased) and (
            attn.qkv_proj.bias is None or qkv_bias.numel()
        )
        input_norm, post_norm, q_norm, k_norm, post_attn_norm, post_mlp_norm = norms
        # (no mixture family has a norm after attention: the kernels take none there)
        mixture_fits = not (experts and post_attn_norm.numel())
        if biases_fit and mixture_fits and all(p is not None for p in packed):
            optional = [q_norm, k_norm, qkv_bias, post_attn_norm, post_mlp_norm]
            if experts:
                packed += [EXPERTS, EXPERTS]
                comm = _collectives(attn.o_proj, attn.o_proj)  # (the mixture reduces itself)
            else:
                comm = _collectives(attn.o_proj, mlp.down_proj)
            args = (
                input_norm, post_norm, layer.input_layernorm.eps, *packed,
                attn.num_heads, attn.num_kv_heads, attn.head_dim, *optional,
                act is gelu_tanh_and_mul, comm,
            )  # fmt: skip
    layer._fused_decode = args
    return args


def conv_layer_arguments(layer) -> tuple | None:
    """A gated short-convolution layer's (LFM2's: models/lfm2.py) fixed arguments as
    short_conv_decode_layer takes them, or None when it is not a shape the kernel runs
    (cached on the layer after the first look): every projection packed quantized and
    unbiased, a silu MLP, float32 norms and taps, one process."""
    cached = getattr(layer, "_fused_conv_decode", False)
    if cached is not False:
        return cached
    conv, mlp = layer.conv, layer.mlp
    if isinstance(mlp, SparseMoE):  # (LFM2-MoE's mixtures run their own way)
        layer._fused_conv_decode = None
        return None
    linears = [conv.in_proj, conv.out_proj, mlp.gate_up_proj, mlp.down_proj]
    packed = [_packed(linear) for linear in linears]
    norms = [layer.input_layernorm.multiplier(), layer.post_attention_layernorm.multiplier()]
    taps, bias = conv.conv.weight, conv.conv.bias
    args = None
    if (
        all(p is not None for p in packed)
        and all(linear.bias is None for linear in linears)
        and mlp.act_and_mul is silu_and_mul
        and all(t.dtype == torch.float32 for t in (*norms, taps))
        and _collectives(conv.out_proj, mlp.down_proj) is None
    ):
        in_proj, out_proj, gate_up, down = packed
        bias = torch.empty(0) if bias is None else bias.float().contiguous()
        eps = layer.input_layernorm.eps
        args = (*norms, eps, in_proj, taps.contiguous(), bias, out_proj, gate_up, down)
    layer._fused_conv_decode = args
    return args


def _collectives(o_proj, down_proj):
    """A tensor-parallel rank's all-reduce, where its o and down projections are
    row-parallel (both or neither); None for one process."""
    methods = [o_proj.method, down_proj.method]
    rows = [isinstance(m, RowParallelLinearMethod) for m in methods]
    if not any(rows):
        return None
    return methods[0].comm if all(rows) else False


def _whole(layer, args: tuple) -> tuple | None:
    """What runs the whole layer in one call, given ``layer_arguments``: () for a dense
    layer (llama_decode_layer), a mixture's arguments after the attention's
    (llama_decode_moe_layer); None where it takes more than one call (a tensor-parallel
    rank's halves, a mixture without the whole-layer call)."""
    gate_up, comm = args[5], args[-1]
    if comm is not None:
        return None
    return () if gate_up is not EXPERTS else layer.mlp.fused_experts.whole_layer


def _stacked(layer, args: tuple) -> tuple | None:
    """What a stack call runs of ``layer`` after its attention: () for a dense layer, a
    mixture's arguments from the router on, None where the layer cannot run in one (see
    ``_whole``). A tensor-parallel rank's layer runs in the ranked stack call where its
    ranks meet in one host's shared memory, its halves and all-reduces there: a
    mixture's too, where its experts' sum is all-reduced by that same group."""
    comm = args[-1]
    if not isinstance(comm, ShmGroup):
        return _whole(layer, args)
    if args[5] is not EXPERTS:
        return ()
    mixture = layer.mlp
    if mixture.all_reduce != comm.all_reduce:
        return None
    return mixture.fused_experts.mlp_arguments


def stack_arguments(layers) -> tuple[list[tuple], list[int], list, ShmGroup | None] | None:
    """Every layer's fixed arguments as kernels/decode_stack.cpp takes them, their
    indices in the KV cache, the mixtures (their ``fused_experts``, to mark their
    counts after the call) and, on a tensor-parallel rank, its shared-memory group;
    None when some layer cannot run in one call (see ``_stacked``; a rank's layers all
    with one group). Cached on ``layers``."""
    cached = getattr(layers, "_fused_stack", False)
    if cached is not False:
        return cached
    plan: tuple[list[tuple], list[int], list, ShmGroup | None] | None = ([], [], [], None)
    groups = set()
    for layer in layers:
        args = layer_arguments(layer)
        mixture = None if args is None else _stacked(layer, args)
        if mixture is None:
            plan = None
            break
        groups.add(args[-1])
        (norm1, norm2, eps, qkv, o_proj, gate_up, down, heads, kv_heads, head_dim,
         q_norm, k_norm, qkv_bias, post_attn_norm, post_mlp_norm, gelu, _) = args  # fmt: skip
        if mixture:
            plan[2].append((layer.mlp.fused_experts, layer.mlp))
            gate_up = down = []
        attn = layer.self_attn
        plan[1].append(attn.cache_index)
        plan[0].append((
            bool(mixture), norm1, norm2, eps, qkv, o_proj, gate_up, down, heads, kv_heads,
            head_dim, attn.cache_index, attn.scale, q_norm, k_norm, qkv_bias, post_attn_norm,
            post_mlp_norm, gelu, layer.rotary_index, mixture,
        ))  # fmt: skip
    if plan is not None and len(groups) > 1:  # (one group, or one process)
        plan = None
    if plan is not None:
        plan = (*plan[:3], groups.pop())
    layers._fused_stack = plan
    return plan


class FusedDecode:
    """``attn.decode_layer`` of a decode-only step: ``(layer, h, residual, rope) ->
    (h, residual)``, or None when the layer must run its own way."""

    def __init__(self, backend: TorchPagedAttention, rows: tuple | None = None) -> None:
        """``rows``: (row lengths, row starts) when sequences have several query rows."""
        self.backend = backend
        group = backend.metadata.groups[0]
        self.block_tables = group.block_tables
        if rows is None:
            self.context_lens, self.row_starts = (
                group.context_lens,
                torch.empty(0, dtype=torch.long),
            )
        else:
            self.context_lens, self.row_starts = rows

    @staticmethod
    def applies(backend: TorchPagedAttention, rows_max: int = 1) -> bool:
        """Every token of the step is a decode (with at most ``rows_max`` - 1 drafts):
        the decodes group is the only group, so its rows are the step's tokens in
        flat-batch order (build_paged_metadata lays them out so)."""
        metadata = backend.metadata
        if metadata.fresh_prompts or len(metadata.groups) != 1:
            return False
        group = metadata.groups[0]
        return group.decodes and group.query_index.shape[1] <= rows_max

    def stack(self, layers, h, ropes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``attn.decode_stack``: every layer of ``layers`` in one call (``ropes``: the
        model's rotary positions, a layer's by its ``rotary_index``) -> (the last
        layer's output, the stream), or None when some layer must run its own way."""
        plan = stack_arguments(layers)
        if plan is None or h.dtype != torch.float32 or h.dim() != 2:
            return None
        if any(rope.cos is not None for rope in ropes):
            return None
        arguments, layer_indices, mixtures, group = plan
        metadata = self.backend.metadata
        windows = [metadata.window(index) or 0 for index in layer_indices]
        step = (
            arguments, windows, [rope.positions for rope in ropes],
            [rope.cos_sin for rope in ropes], self.backend.kv_cache, metadata.slot_mapping,
            self.block_tables, self.context_lens, self.row_starts,
        )  # fmt: skip
        kernels = cpu_kernels.load()
        if group is not None:  # a rank: the all-reduces in the call, in the group's slots
            if h.numel() > group.floats.shape[-1]:
                return None
            out = group.reduce_in(
                lambda h, residual, *meet: kernels.llama_decode_stack_ranked(
                    h, residual, *step, *meet
                ),
                h,
            )
        else:
            out = kernels.llama_decode_stack(h, *step)
        for fused, moe in mixtures:  # (the call wrote the counts into their tables)
            fused.counted(moe)
        return out[0], out[1]

    def short_conv_layer(self, layer, h, residual, batch):
        """A gated short-convolution layer (``conv_layer_arguments``) in one call where
        every sequence runs one token (``batch``: the step's RecurrentBatch) -> (h,
        residual), or None (drafts verified: the layer's own way rolls back)."""
        args = conv_layer_arguments(layer)
        if args is None or not batch.decodes or h.dtype != torch.float32 or h.dim() != 2:
            return None
        norm1, norm2, eps, in_proj, taps, bias, out_proj, gate_up, down = args
        (windows,) = batch.states(layer.conv.layer_idx)
        residual = h.new_empty(0) if residual is None else residual
        out, residual = cpu_kernels.load().short_conv_decode_layer(
            h, residual, norm1, norm2, eps, in_proj, taps, bias, windows, batch.slots,
            out_proj, gate_up, down,
        )  # fmt: skip
        return out, residual

    def __call__(self, layer, h, residual, rope):
        args = layer_arguments(layer)
        if args is None or rope.cos is not None or h.dtype != torch.float32 or h.dim() != 2:
            return None
        layer_idx = layer.self_attn.cache_index
        window = self.backend.metadata.window(layer_idx) or 0
        (norm1, norm2, eps, qkv, o_proj, gate_up, down, heads, kv_heads, head_dim,
         q_norm, k_norm, qkv_bias, post_attn_norm, post_mlp_norm, gelu, comm) = args  # fmt: skip
        if comm is False:
            return None
        kernels = cpu_kernels.load()
        residual = h.new_empty(0) if residual is None else residual
        experts = gate_up is EXPERTS
        attention = (
            heads, kv_heads, head_dim, rope.positions, rope.cos_sin, self.backend.kv_cache,
            layer_idx, self.backend.metadata.slot_mapping, self.block_tables,
            self.context_lens, self.row_starts, layer.self_attn.scale, window, q_norm, k_norm,
            qkv_bias,
        )  # fmt: skip
        whole = _whole(layer, args)
        if whole == ():
            return kernels.llama_decode_layer(
                h, residual, norm1, norm2, eps, qkv, o_proj, gate_up, down, *attention,
                post_attn_norm, post_mlp_norm, gelu,
            )  # fmt: skip
        if whole is not None:  # a mixture's whole layer
            out, residual = kernels.llama_decode_moe_layer(
                h, residual, norm1, norm2, eps, qkv, o_proj, *attention, *whole
            )
            layer.mlp.fused_experts.counted(layer.mlp)  # (the call wrote its counts)
            return out, residual
        if experts:  # attention compiled, then the mixture (its own kernel call)
            o, residual = kernels.llama_decode_attention(
                h, residual, norm1, eps, qkv, o_proj, *attention
            )
            if comm is not None:
                comm.all_reduce(o)
            h, residual = layer.post_attention_layernorm(o, residual)
            return layer.mlp(h), residual
        # A tensor-parallel rank: each half ends in its partial sums, all-reduced here.
        o, residual = kernels.llama_decode_attention(
            h, residual, norm1, eps, qkv, o_proj, *attention
        )
        comm.all_reduce(o)
        out, residual = kernels.llama_decode_mlp(
            o, residual, post_attn_norm, norm2, eps, gate_up, down, gelu
        )
        comm.all_reduce(out)
        if post_mlp_norm.numel():
            normed = torch.empty_like(out)
            kernels.rms_norm(normed, out, None, post_mlp_norm, eps)
            out = normed
        return out, residual
