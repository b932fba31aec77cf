"""A mixture's experts on the compiled kernels: from the router's logits to the layer's
output in one call (kernels/moe_ops.cpp), each projection of every picked expert in
one parallel loop (quant_ops.cpp's run_many), instead of one call per expert and the
Python between.

At batch 1 a Qwen3-30B-A3B layer runs 8 experts, each a gate/up of 1,536 x 2,048 and
a down of 2,048 x 768: matrices of 1-2 MB, which one kernel call reads in tens of
microseconds, about what the call costs around it (Python, dispatch, the threads'
start and join). Here the layer makes two passes (gate/up of every picked expert,
then down of every one), and each pass's threads go through all its experts' tiles
without meeting in between.

    route     softmax of the router's logits in float32, the top k, renormalized as
              the family says (moe_route, which models/moe.py's route calls too); each
              pick times its expert's output scale where the layer has them (Gemma 4,
              whose router also reads another input than the experts: ``logits``)
    slots     the batch's (token, expert) picks, sorted by expert (stable: a token's
              picks stay in order), the tokens' rows gathered in that order
    gate/up   one pass: expert e's rows x its gate/up matrix, for every picked e
    act       silu(gate) * up (or GELU-tanh, or gpt-oss's clamped SwiGLU) over those
              rows; gpt-oss's experts' biases added by the two passes, as each
              expert's own call adds them
    down      one pass, the same way
    combine   each row times its routing weight, added into its token's row in the
              sorted order: the same sum, in the same order, as models/moe.py's loop,
              and the same kernels, so the result is the loop's bit for bit

A prompt chunk's slots go through these steps in rounds of at most MLP_ROWS (the
sorted slots cut between experts, or every MLP_ROWS rows of one), so its temporaries
stay bounded as the dense MLP's do.

``attach_fused_experts`` gives a SparseMoE layer this path where every expert's
gate/up and down are each one packed matrix (runner/linear/quantized.py joins a
gate/up pair of one layout) and all experts of a projection share one layout (the
experts of a GGUF stack do); otherwise the layer keeps its loop.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels import cpu as cpu_kernels
from tandem.models.layers import gelu_tanh_and_mul
from tandem.models.llama import MLP_ROWS
from tandem.models.moe import SparseMoE
from tandem.quant.packed import PackedWeight
from tandem.runner.linear.cpu_small_batch import CpuSmallBatchLinearMethod


def _layout(weight: PackedWeight) -> tuple:
    """What the kernel assumes every expert of a projection shares with the first (it
    reads each one's tensors from their addresses alone, so they must be contiguous)."""
    tensors = [weight.values, weight.scales] + ([] if weight.corr is None else [weight.corr])
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("not contiguous")
    return (weight.rows, weight.group, weight.offset, weight.factor, weight.table,
            weight.values.dtype,
            weight.values.shape, weight.scales.dtype, weight.scales.shape,
            weight.corr is None)  # fmt: skip


class _Projection:
    """One projection (gate/up, or down) of every expert of a layer, as the kernel
    takes it: the first expert's matrix (whose layout every expert shares:
    ``attach_fused_experts`` checks it) and a table of each expert's addresses. Holding
    ``weights`` keeps those addresses valid; the table spares the call converting a
    list of tensors per expert on every call (more than a layer's gate/up pass takes)."""

    def __init__(self, weights: list[PackedWeight]) -> None:
        self.weights = weights
        first = weights[0]
        empty = torch.empty(0, dtype=torch.float16)
        where = [
            [w.values.data_ptr(), w.scales.data_ptr(), 0 if w.corr is None else w.corr.data_ptr()]
            for w in weights
        ]
        self.args = (
            torch.tensor(where, dtype=torch.int64), first.values, first.scales,
            first.corr if first.corr is not None else empty, first.rows, first.group, first.offset,
            first.factor, first.table,
        )  # fmt: skip


class FusedExperts:
    def __init__(self, layer: SparseMoE) -> None:
        experts = list(layer.experts.values())  # the held ones, in order (models/moe.py)
        self.gate_up = _Projection([_only_part(e.gate_up_proj) for e in experts])
        self.down = _Projection([_only_part(e.down_proj) for e in experts])
        self.gelu = experts[0].act_and_mul is gelu_tanh_and_mul
        # gpt-oss's: each expert's biases by address (held here), its clamped SwiGLU.
        self.biases = [[_float_bias(getattr(e, p)) for e in experts] for p in PROJECTIONS]
        alpha, limit = getattr(experts[0], "swiglu", (0.0, 0.0))
        # Gemma 4's: each expert's output scale, times its picks' weights.
        scale = getattr(layer, "per_expert_scale", None)
        self.expert_scale = torch.empty(0) if scale is None else scale.detach().float().contiguous()
        self.extras = (*(_addresses(b) for b in self.biases), alpha, limit, self.expert_scale)
        # The tokens each expert took in the last forward: ``layer.expert_load`` reads
        # this table (converted once a step by the runner, not a tensor a layer).
        self.load = torch.zeros(layer.num_experts, dtype=torch.int64)
        # The arguments to the compiled MLP half after the attention's
        # (kernels/moe_ops.cpp's mixture_mlp: the router, the rows up to which its
        # linear method runs the small-batch kernel, moe_experts', the table), or None
        # where it would not compute what ``layer(x)`` does before its all-reduce: a
        # shared expert, a router the call does not take (runner/fused_decode.py then
        # calls the layer). ``whole_layer``: the same for the whole-layer call of one
        # process (llama_decode_moe_layer), None on a tensor-parallel rank, whose
        # partial sum is all-reduced (the ranked stack call does that: see
        # runner/fused_decode.py). attach_fused_experts runs after the linear methods
        # and collectives are set, so both are known here.
        self.mlp_arguments = self._mlp_arguments(layer)
        self.whole_layer = self.mlp_arguments if layer.all_reduce is None else None

    def __call__(
        self, layer: SparseMoE, x: torch.Tensor, logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``logits``: the router's, where it reads another input than the experts'
        (Gemma 4's); else ``layer.gate(x)``."""
        if logits is None:
            logits = layer.gate(x)
        out, counts = cpu_kernels.load().moe_experts(
            x.float().contiguous(), logits, *self._experts(layer), *self.extras
        )
        self.load.copy_(counts)
        self.counted(layer)
        return out.to(x.dtype)

    def _experts(self, layer: SparseMoE) -> tuple:
        """moe_experts' arguments after the router's logits."""
        return (layer.top_k, layer.normalize, *self.gate_up.args, *self.down.args, self.gelu,
                MLP_ROWS, layer.held.start)  # fmt: skip

    def _mlp_arguments(self, layer: SparseMoE) -> tuple | None:
        gate = layer.gate
        method = gate.method
        if (
            layer.shared_expert is not None
            or not isinstance(method, CpuSmallBatchLinearMethod)
            or gate.bias is not None
            or self.extras[-2] > 0  # (the whole-layer call takes no SwiGLU nor biases,
            or self.expert_scale.numel()  # nor expert scales)
            or gate.weight.dtype != torch.float32
            or not gate.weight.is_contiguous()
        ):
            return None
        return (gate.weight, method.max_rows, *self._experts(layer), self.load)

    def counted(self, layer: SparseMoE) -> None:
        """After either call has written its counts into ``self.load``: the layer's
        ``expert_load`` is that table (the per-expert loop, with autograd on, sets a
        list of its own in between)."""
        if layer.__dict__.get("_expert_load") is not self.load:
            layer.expert_load = self.load


PROJECTIONS = ("gate_up_proj", "down_proj")


def _float_bias(linear: nn.Module) -> torch.Tensor | None:
    """The float32 bias a packed matrix's call adds (runner/linear/quantized.py)."""
    bias = getattr(linear, "float_bias", linear.bias)
    return None if bias is None else bias.contiguous()


def _addresses(biases: list[torch.Tensor | None]) -> torch.Tensor:
    """Each expert's bias by address, or empty when the experts have none."""
    if all(b is None for b in biases):
        return torch.empty(0, dtype=torch.int64)
    if any(b is None for b in biases):
        raise ValueError("some experts' biases missing")
    return torch.tensor([b.data_ptr() for b in biases], dtype=torch.int64)


def _only_part(linear: nn.Module) -> PackedWeight:
    (start, weight), *rest = getattr(linear, "packed_parts", None) or [(None, None)]
    if rest or start != 0 or weight is None:
        raise ValueError("not one packed matrix")
    return weight


def attach_fused_experts(model: nn.Module) -> int:
    """Every SparseMoE layer of ``model`` whose experts the kernel can run gets
    ``fused_experts`` (after the linear methods were set); returns how many did."""
    if cpu_kernels.load() is None:
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, SparseMoE):
            continue
        experts = list(module.experts.values())
        if experts[0].act_and_mul is None or len({getattr(e, "swiglu", None) for e in experts}) > 1:
            continue
        if module.scoring != "softmax":  # (the kernel routes by softmax only)
            continue
        try:
            fused = FusedExperts(module)
            layouts = [
                {_layout(_only_part(getattr(e, projection))) for e in experts}
                for projection in PROJECTIONS
            ]
        except ValueError:  # not one packed matrix each, or not contiguous
            continue
        if all(len(layout) == 1 for layout in layouts):
            module.fused_experts = fused
            count += 1
    return count
