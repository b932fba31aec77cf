"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5 and Qwen3-Next.

In place of attention over a growing K/V cache, each sequence carries two fixed-size
states through its tokens (the state cache: runner/state_cache.py):

    x -> in_proj -> [q k v | z | b | a]      (Qwen3-Next: [q k v | z | b a per key head])
    q k v -> causal depthwise conv (width 4, state: the last 3 inputs) -> silu
    q, k: L2-normalized per head (q then scaled by Dk^-0.5), repeated to the value heads
    beta = sigmoid(b), g = A * softplus(a + dt_bias)      (per value head; A = -exp(A_log))
    o = gated delta rule(q, k, v, g, beta)      (state: [Hv, Dk, Dv] per sequence)
    out_proj(rmsnorm(o) * silu(z))      (the norm per head, its weight plain)

as transformers' ``Qwen3_5GatedDeltaNet`` computes it. With more value heads than key
heads, value head j reads key head j // r (Hugging Face's order, grouped by key head) or
j % Hk (``tiled_value_heads``: the order llama.cpp's converter writes). The convolution
is kernels/causal_conv.py's, the recurrence kernels/delta_rule.py's: a step's decodes run
one batched step over their slots (on the CPU the whole layer after its projection in
one compiled call: delta_rule_ops.cpp); a prompt (or a chunk of one) runs the chunked
form, in its sequence's slot; a decode verifying drafts runs a step a token and leaves
the runner a way back to the last accepted token (runner/state_cache.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu as cpu_kernels
from tandem.kernels.causal_conv import convolve
from tandem.kernels.delta_rule import chunked_gated_delta_rule, gated_delta_rule_step
from tandem.models.config import ModelConfig
from tandem.models.layers import AttentionContext
from tandem.models.linear import Linear, MergedLinear

L2_EPS = 1e-6  # as the flash-linear-attention kernels normalize q and k


def delta_net_shapes(options: dict) -> tuple[tuple[int, ...], ...]:
    """One sequence's states in one layer: the convolution's window [C, width - 1] and
    the delta rule's matrices [Hv, Dk, Dv] (``options``: the family's config keys)."""
    conv_dim = 2 * options["key_heads"] * options["key_dim"]
    conv_dim += options["value_heads"] * options["value_dim"]
    return (
        (conv_dim, options["conv_width"] - 1),
        (options["value_heads"], options["key_dim"], options["value_dim"]),
    )


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (weight plain), times silu of the gate z."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


class DepthwiseConv(nn.Module):
    """The causal convolution's taps, [channels, width] (checkpoints' Conv1d weight
    [channels, 1, width] without its middle axis, as GGUF files hold it), and a bias
    per channel if it has one."""

    def __init__(self, channels: int, width: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        o = config.family_options
        self.layer_idx = layer_idx
        self.key_heads, self.key_dim = o["key_heads"], o["key_dim"]
        self.value_heads, self.value_dim = o["value_heads"], o["value_dim"]
        key_size = self.key_heads * self.key_dim
        value_size = self.value_heads * self.value_dim
        self.conv_dim = 2 * key_size + value_size
        # q k v, z, b, a in one projection (the checkpoint's four: packed_modules); or
        # Qwen3-Next's b and a in one part, interleaved per key head ([b, a] of its
        # value heads, for each key head in turn: ``interleaved_ba``).
        self.interleaved_ba = bool(o.get("interleaved_ba"))
        ba = [2 * self.value_heads] if self.interleaved_ba else [self.value_heads] * 2
        self.split_sizes = [self.conv_dim, value_size, *ba]
        self.in_proj = MergedLinear(config.hidden_size, self.split_sizes, bias=False)
        self.conv1d = DepthwiseConv(self.conv_dim, o["conv_width"])
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads))
        self.A = nn.Parameter(torch.empty(self.value_heads))  # -exp(A_log): GGUF's ssm_a
        self.tiled_value_heads = bool(o.get("tiled_value_heads"))
        self.norm = GatedRMSNorm(self.value_dim, config.norm_eps)
        self.out_proj = Linear(value_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        tokens = x.shape[0]
        qkv, z, *ba = self.in_proj(x).split(self.split_sizes, dim=-1)
        b, a = self._interleaved(ba[0]) if self.interleaved_ba else ba
        batch = attn.recurrent
        conv_states, delta_states = batch.states(self.layer_idx)
        kernels = cpu_kernels.load() if cpu_kernels.usable(conv_states) else None
        if batch.decodes and kernels is not None:  # the step in one compiled call
            out = torch.empty(tokens, self.value_heads * self.value_dim)
            kernels.gated_delta_net_step(
                out, *(t.float().contiguous() for t in (qkv, z, b, a, self.conv1d.weight)),
                conv_states, self.A.float(), self.dt_bias.float(), self.norm.weight.float(),
                delta_states, batch.slots, self.key_heads, self.tiled_value_heads,
                self.norm.eps,
            )  # fmt: skip
            return self.out_proj(out.to(x.dtype))
        # (a verifying sequence: its conv window after each token, by slot)
        mixed, conv_after = convolve(qkv, self.conv1d.weight, conv_states, batch)
        mixed = F.silu(mixed)
        key_size = self.key_heads * self.key_dim
        q, k, v = mixed.split([key_size, key_size, self.value_heads * self.value_dim], dim=-1)
        repeat = self.value_heads // self.key_heads
        q = l2_normalized(q.view(tokens, self.key_heads, self.key_dim)) * self.key_dim**-0.5
        k = l2_normalized(k.view(tokens, self.key_heads, self.key_dim))
        if repeat > 1 and self.tiled_value_heads:  # value head j reads key head j % Hk
            q, k = q.repeat(1, repeat, 1), k.repeat(1, repeat, 1)
        elif repeat > 1:  # value head j reads key head j // repeat
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        v = v.reshape(tokens, self.value_heads, self.value_dim)
        beta = torch.sigmoid(b.float())
        g = self.A.float() * F.softplus(a.float() + self.dt_bias.float())
        out = batch.recur(
            (q, k, v, g, beta),
            torch.empty(tokens, self.value_heads, self.value_dim, device=x.device),
            chunked_gated_delta_rule, gated_delta_rule_step, delta_states, conv_after, conv_states,
        )  # fmt: skip
        out = self.norm(out.to(x.dtype), z.reshape(tokens, self.value_heads, self.value_dim))
        return self.out_proj(out.reshape(tokens, -1))

    def _interleaved(self, ba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 2 Hv] with each key head's [b, a] together -> b, a [T, Hv] (value heads in
        Hugging Face's order)."""
        per_key = ba.view(ba.shape[0], self.key_heads, 2, self.value_heads // self.key_heads)
        return per_key[:, :, 0].reshape(ba.shape[0], -1), per_key[:, :, 1].reshape(ba.shape[0], -1)
