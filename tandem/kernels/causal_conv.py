"""The short causal convolution of hybrid models' recurrent layers (before Gated
DeltaNet's delta rule; LFM2's whole token mixer).

Depthwise over channels, ``width`` taps, causal: output t of channel c is
sum_j weight[c, j] * x[t - width + 1 + j, c]. A sequence's state is its last
``width - 1`` inputs, oldest first, so a prompt's next chunk (or its decode) continues
where the last one stopped; a sequence at position 0 starts from zeros (its cleared
slot in the state cache: runner/state_cache.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [L, C], ``weight`` [C, width], ``state`` [C, width - 1] (its
    previous inputs, oldest first) -> (y [L, C] before any activation, in x's dtype;
    the new state, float32)."""
    width = weight.shape[-1]
    full = torch.cat([state.to(x.dtype), x.t()], dim=-1)  # [C, width - 1 + L]
    y = F.conv1d(full[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]
    return y.t(), full[:, full.shape[-1] - (width - 1) :].float()


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One token for each of B sequences: x [B, C]; ``states`` [slots, C, width - 1],
    sequence b's at ``slots[b]``, updated in place -> y [B, C] before any activation."""
    window = torch.cat([states[slots], x.float()[..., None]], dim=-1)  # [B, C, width]
    states[slots] = window[..., 1:]
    return (window * weight.float()).sum(-1).to(x.dtype)


def windows_after(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The window (the last width - 1 inputs) after each of x's [n, C] rows, from
    ``state`` [C, width - 1] -> [n, C, width - 1] float32."""
    kept = state.shape[-1]
    full = torch.cat([state.float(), x.float().t()], dim=-1)  # [C, width - 1 + n]
    return full.unfold(-1, kept, 1)[:, 1:].transpose(0, 1).contiguous()


def convolve(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, batch
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Every sequence of ``batch`` (a runner/state_cache.RecurrentBatch: sequence s's
    rows of x [T, C], its window at ``states[slot]``) through the convolution, windows
    updated -> (y [T, C] before any activation; for each sequence verifying drafts,
    by slot, its windows after each of its tokens: ``windows_after``, what a
    speculative rollback restores)."""
    if batch.decodes:
        return causal_conv_step(x, weight, states, batch.slots), {}
    y = x.new_empty(x.shape)
    after = {}
    for s, (start, n, slot) in enumerate(
        zip(batch.starts, batch.lens, batch.host_slots, strict=True)
    ):
        rows = slice(start, start + n)
        if batch.verifies(s):  # (before the slot is overwritten)
            after[slot] = windows_after(states[slot], x[rows])
        y[rows], states[slot] = causal_conv(x[rows], weight, states[slot])
    return y, after
