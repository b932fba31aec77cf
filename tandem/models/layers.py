"""Building blocks shared by every model family.

Models never see the KV cache: each attention layer hands its q, k, v to an
``AttentionContext`` (paged cache, or plain causal attention without a cache), which the
runner builds once per forward. That is what lets one model definition serve the
engine's flat mixed batches, the naive no-cache baseline and training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.errors import ModelLoadError
from tandem.kernels import cpu as cpu_kernels
from tandem.kernels import cuda as cuda_kernels
from tandem.models.config import RopeConfig


class AttentionContext(Protocol):
    # A hybrid model's recurrent layers read their sequences and state slots here
    # (runner/state_cache.py's RecurrentBatch: each sequence's rows of the flat batch,
    # its slot, ``states(layer)``); the runner sets it on every forward of a hybrid.
    recurrent: Any

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] for the T tokens of this forward -> [T, H, D].
        ``sinks`` [H] (gpt-oss): a learned logit per query head that joins each row's
        softmax and adds no value (its share of the weight is dropped)."""
        ...


class RMSNorm(nn.Module):
    """``norm(x)``, or with the residual stream ``norm(x, residual) -> (normed, sum)``
    where ``sum = x + residual``: the pre-norm block's add and norm in one pass. On the
    kernel paths (CPU, CUDA) the sum is written into ``residual`` in place."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and cpu_kernels.usable(x):
            out = torch.empty_like(x)
            cpu_kernels.load().rms_norm(out, x, residual, self.multiplier(), self.eps)
            return out if residual is None else (out, residual)
        if x.dim() == 3 and residual is None and x.stride(2) == 1 and cpu_kernels.usable(x):
            out = x.new_empty(x.shape)  # per head (q/k norms), strided tokens and heads
            cpu_kernels.load().rms_norm_heads(out, x, self.multiplier(), self.eps)
            return out
        if cuda_kernels.enabled(x) and x.stride(-1) == 1 and x.dim() in (2, 3):
            if residual is None:
                return cuda_kernels.rms_norm(x, self.multiplier(), self.eps)
            if x.dim() == 2 and residual.stride(-1) == 1:
                return cuda_kernels.rms_norm(x, self.multiplier(), self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def multiplier(self) -> torch.Tensor:
        """What the normalised values are multiplied by (Gemma's norm: 1 + weight)."""
        return self.weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as the reference does, so
        # bfloat16 results agree bit for bit rather than approximately.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2N] -> silu(x[:, :N]) * x[:, N:]: the gated MLP's activation in one pass."""
    return _act_and_mul(x, "silu_and_mul", F.silu)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2N] -> gelu_tanh(x[:, :N]) * x[:, N:]: GeGLU in one pass."""
    return _act_and_mul(x, "gelu_tanh_and_mul", lambda g: F.gelu(g, approximate="tanh"))


def _act_and_mul(x: torch.Tensor, kernel: str, act) -> torch.Tensor:
    size = x.shape[-1] // 2
    if x.dim() == 2 and cpu_kernels.usable(x):
        out = x.new_empty(x.shape[0], size)
        getattr(cpu_kernels.load(), kernel)(out, x)
        return out
    if x.dim() == 2 and x.stride(-1) == 1 and cuda_kernels.enabled(x):
        return cuda_kernels.act_and_mul(x, gelu=kernel != "silu_and_mul")
    return act(x[..., :size]) * x[..., size:]


def clamped_swiglu_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[T, 2N] -> gpt-oss's clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g *
    sigmoid(alpha * g), g = min(gate, limit); on the CPU the kernel its experts' one
    call runs too (runner/linear/experts.py)."""
    size = x.shape[-1] // 2
    if x.dim() == 2 and cpu_kernels.usable(x):
        out = x.new_empty(x.shape[0], size)
        cpu_kernels.load().clamped_swiglu_and_mul(out, x, alpha, limit)
        return out
    gate = x[..., :size].clamp(max=limit)
    up = x[..., size:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# Gated MLP activations computed in one pass with the up projection.
FUSED_ACTIVATIONS = {
    "silu": silu_and_mul,
    "gelu_new": gelu_tanh_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_fast": gelu_tanh_and_mul,
}


def in_row_slices(fn, x: torch.Tensor, rows: int) -> torch.Tensor:
    """fn over x [N, ...] ``rows`` rows at a time, into one output: for a row-wise fn
    whose temporaries are much wider than its input and output (an MLP's), so that only
    one slice's are alive at once. Same result as fn(x) when fn treats rows alike."""
    if x.shape[0] <= rows:
        return fn(x)
    first = fn(x[:rows])
    out = first.new_empty(x.shape[0], *first.shape[1:])
    out[:rows] = first
    del first
    for start in range(rows, x.shape[0], rows):
        out[start : start + rows] = fn(x[start : start + rows])
    return out


def activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "relu":
        return F.relu
    raise ModelLoadError(f"activation {name!r} is not supported")


def rope_inv_freq(rope: RopeConfig, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin multiplier for each rope scaling type.

    Same math as transformers' rope initialisers. ``dynamic`` NTK scaling only changes
    the frequencies past the trained ``max_position_embeddings``, which is also the
    longest context tandem accepts for such a model, so inside it it is plain rope,
    exactly what transformers computes.
    """
    dim = rope.rotary_dim
    base = rope.theta
    s = rope.scaling
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if rope.scaling_type == "linear":
        return inv_freq / s["factor"], 1.0
    if rope.scaling_type == "llama3":
        return _llama3_inv_freq(inv_freq, s), 1.0
    if rope.scaling_type == "yarn":
        return _yarn_inv_freq(rope, max_position_embeddings)
    if rope.scaling_type == "proportional":
        # The first partial_rotary_factor of the pairs turn as in a full-head rotary;
        # the rest have frequency 0 (cos 1, sin 0: left as they are).
        turning = int(s["partial_rotary_factor"] * dim // 2)
        inv_freq[turning:] = 0.0
        return inv_freq / s.get("factor", 1.0), 1.0
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    s, dim, base = rope.scaling, rope.rotary_dim, rope.theta
    original = s.get("original_max_position_embeddings") or max_position_embeddings
    factor = s.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


@dataclass
class RotaryPositions:
    """One forward's positions, prepared once for every layer's rotary."""

    positions: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor  # [P, rotary_dim] float32: cos | sin halves for positions < P
    # The torch path's [T, 1, rotary_dim] cos and sin in the model dtype (None on the
    # kernel path, which reads cos_sin directly).
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate the two halves).

    cos/sin come from a float32 table over positions, grown as longer sequences
    arrive; each entry is computed exactly as the reference computes it per forward
    (position * inverse frequency in float32, then cos and sin, times the attention
    factor), so the numerics do not change.
    """

    def __init__(self, rope: RopeConfig, max_position_embeddings: int) -> None:
        super().__init__()
        # Models are built on the meta device and materialised by the loader, so the
        # table is made on first use, on the device of the positions.
        self.rope = rope
        self.max_position_embeddings = max_position_embeddings
        self.rotary_dim = rope.rotary_dim
        self._cos_sin: torch.Tensor | None = None

    def _table(self, num_positions: int, device: torch.device) -> torch.Tensor:
        table = self._cos_sin
        if table is None or table.device != device or table.shape[0] < num_positions:
            size = max(4096, 1 << (num_positions - 1).bit_length())
            with torch.device("cpu"):
                inv_freq, factor = rope_inv_freq(self.rope, self.max_position_embeddings)
                freqs = torch.arange(size).float()[:, None] * inv_freq[None, :]
                # (torch's first vectorized cos and sin of a process sometimes came out
                # with ~11 correct bits, 1e-4 off, in pytest workers; a repeat was right)
                freqs.cos(), freqs.sin()
                table = torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1)
            self._cos_sin = table = table.to(device)
        return table

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryPositions:
        # The largest position is known on the host when positions live there; on a GPU
        # the table is sized to the model's context once instead of syncing.
        if positions.device.type == "cpu":
            needed = int(positions.max()) + 1 if len(positions) else 1
        else:
            needed = self.max_position_embeddings
        table = self._table(needed, positions.device)
        prepared = RotaryPositions(positions, table)
        if not cpu_kernels.enabled(positions.device, dtype) and not cuda_kernels.enabled(table):
            half = self.rotary_dim // 2
            rows = table[positions]
            cos, sin = rows[:, :half], rows[:, half:]
            prepared.cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
            prepared.sin = torch.cat((sin, sin), dim=-1).to(dtype)[:, None, :]
        return prepared

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, rope: RotaryPositions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] -> rotated (in place on the kernel paths)."""
        if rope.cos is None:
            if q.is_cuda:
                cuda_kernels.rotary(q, k, rope.positions, rope.cos_sin)
            else:
                cpu_kernels.load().rotary(q, k, rope.positions, rope.cos_sin)
            return q, k
        return self._rotated(q, rope.cos, rope.sin), self._rotated(k, rope.cos, rope.sin)

    def _rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
