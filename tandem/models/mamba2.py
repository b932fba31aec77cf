"""The Mamba-2 mixer: the state-space token mixer of Granite 4.0-H (and of Falcon-H1,
Nemotron-H and Mamba-2 itself).

Each sequence carries two fixed-size states through its tokens (the state cache:
runner/state_cache.py): its convolution's window and the SSD state [H, N, P] per head:

    x -> in_proj -> [z | x B C | dt]
    x B C -> causal depthwise conv (width d_conv, a bias) -> silu
    dt = clamp(softplus(dt + dt_bias), time_step_limit)        (per head; A = -exp(A_log))
    y = SSD(x, dt, A, B, C) + D x      (kernels/ssd.py; B and C shared by a group's heads)
    out_proj(rmsnorm_per_group(y * silu(z)) * weight)

as transformers' ``GraniteMoeHybridMambaLayer`` (Mamba2Mixer) computes it. A step's
decodes run one batched step over their slots (on the CPU the whole mixer after its
projection in one compiled call: ssd_ops.cpp); a prompt (or a chunk of one) runs the
chunked form from its slot's state; a decode verifying drafts runs a step a token and
leaves the runner a way back (runner/state_cache.py's ``RecurrentBatch.recur``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu as cpu_kernels
from tandem.kernels.causal_conv import convolve
from tandem.kernels.ssd import chunked_ssd, ssd_step
from tandem.models.config import ModelConfig
from tandem.models.gated_delta_net import DepthwiseConv
from tandem.models.layers import AttentionContext
from tandem.models.linear import Linear


def mamba2_shapes(options: dict) -> tuple[tuple[int, ...], ...]:
    """One sequence's states in one layer: the conv window [x B C channels, d_conv - 1]
    and the SSD state [H, N, P] (``options``: the family's mamba keys)."""
    inner = options["heads"] * options["head_dim"]
    conv_dim = inner + 2 * options["groups"] * options["state"]
    return (
        (conv_dim, options["conv_width"] - 1),
        (options["heads"], options["state"], options["head_dim"]),
    )


class GroupedGatedRMSNorm(nn.Module):
    """y * silu(z), RMS-normed over each group's channels, times the weight."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        grouped = h.view(*h.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        o = config.family_options["mamba"]
        self.layer_idx = layer_idx
        self.heads, self.head_dim = o["heads"], o["head_dim"]
        self.groups, self.state = o["groups"], o["state"]
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state
        self.split_sizes = [self.inner, self.conv_dim, self.heads]
        self.in_proj = Linear(config.hidden_size, sum(self.split_sizes), bias=o["proj_bias"])
        self.conv1d = DepthwiseConv(self.conv_dim, o["conv_width"], bias=o["conv_bias"])
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A = nn.Parameter(torch.empty(self.heads))  # -exp(A_log)
        self.D = nn.Parameter(torch.empty(self.heads))
        self.dt_limit = tuple(o["time_step_limit"])
        self.norm = GroupedGatedRMSNorm(self.inner, self.groups, config.norm_eps)
        self.out_proj = Linear(self.inner, config.hidden_size, bias=o["proj_bias"])

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        tokens = x.shape[0]
        projected = self.in_proj(x)
        batch = attn.recurrent
        conv_states, ssd_states = batch.states(self.layer_idx)
        if batch.decodes and projected.dtype == torch.float32 and cpu_kernels.usable(projected):
            return self.out_proj(self._step_in_one_call(projected, conv_states, ssd_states, batch))
        z, xbc, dt = projected.split(self.split_sizes, dim=-1)
        # (a verifying sequence: its conv window after each token, by slot)
        mixed, conv_after = convolve(xbc, self.conv1d.weight, conv_states, batch)
        if self.conv1d.bias is not None:
            mixed = mixed + self.conv1d.bias.to(mixed.dtype)
        mixed = F.silu(mixed)
        bc = self.groups * self.state
        xs, B, C = mixed.split([self.inner, bc, bc], dim=-1)
        xs = xs.reshape(tokens, self.heads, self.head_dim)
        per_group = self.heads // self.groups
        B = B.reshape(tokens, self.groups, self.state).repeat_interleave(per_group, dim=1)
        C = C.reshape(tokens, self.groups, self.state).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        A = self.A.float()
        y = batch.recur(
            (xs, dt, B, C), torch.empty(tokens, self.heads, self.head_dim, device=x.device),
            functools.partial(_with_A, chunked_ssd, A), functools.partial(_with_A, ssd_step, A),
            ssd_states, conv_after, conv_states,
        )  # fmt: skip
        y = y + self.D.float()[:, None] * xs.float()
        y = self.norm(y.reshape(tokens, self.inner).to(x.dtype), z)
        return self.out_proj(y)

    def _step_in_one_call(self, projected, conv_states, ssd_states, batch) -> torch.Tensor:
        """A decode step after in_proj on the CPU kernels (ssd_ops.cpp: the same math,
        each state read and written once) -> the gated norm's output [S, inner]."""
        out = torch.empty(projected.shape[0], self.inner)
        bias = self.conv1d.bias
        cpu_kernels.load().mamba2_step(
            out, projected.contiguous(), self.conv1d.weight.float().contiguous(),
            torch.empty(0) if bias is None else bias.float().contiguous(), conv_states,
            self.dt_bias.float(), self.A.float(), self.D.float(), self.norm.weight.float(),
            ssd_states, batch.slots, self.groups, *self.dt_limit, self.norm.eps,
        )  # fmt: skip
        return out


def _with_A(rule, A, x, dt, B, C, *states):
    """``rule`` (chunked_ssd, ssd_step) with the layer's A between a token's dt and B."""
    return rule(x, dt, A, B, C, *states)
