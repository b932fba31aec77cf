"""Mamba-2's state-space recurrence (SSD: the state space dual), for prompts in chunked
form and for decode one step at a time.

Per head, with a state S [N, P] carried from token to token, a_t = exp(dt_t A) (A < 0),
input x_t [P], and the token's B_t, C_t [N] (shared by the heads of a group)::

    S_t = a_t S_{t-1} + B_t (dt_t x_t)^T
    y_t = S_t^T C_t + D x_t

It is linear attention with a decay (C the query, B the key, dt x the value), so the
chunked form is the gated delta rule's (kernels/delta_rule.py) without its correction:
within a chunk, with G_i the cumulative log decay up to token i,

    Y = (C exp(G)) S + lower(C B^T * exp(G_i - G_j)) V       (the diagonal included)
    S <- exp(G_C) S + (B exp(G_C - G))^T V

as transformers' ``mamba2_chunk_scan`` and the mamba_ssm kernels compute it (their state
[P, N] is this one transposed). Everything is float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.delta_rule import CHUNK, decay_exp


def chunked_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [L, H, P], dt [L, H] (after its bias, softplus and limits), A [H],
    B/C [L, H, N] (each head's group's), state [H, N, P] (float32, before these tokens)
    -> (y [L, H, P] float32 without the D skip, the state after them)."""
    length, heads, p = x.shape
    pad = (-length) % chunk
    n = (length + pad) // chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, n, C, ...]
        t = t.float().transpose(0, 1)
        if pad:
            t = F.pad(t, (0, 0, 0, pad) if t.dim() == 3 else (0, pad))
        return t.reshape(heads, n, chunk, *t.shape[2:])

    v = chunks(x * dt.float()[..., None])
    g = chunks(dt.float() * A.float())  # log decays; padding adds none (dt = 0 there)
    k, q = chunks(B), chunks(C)
    G = g.cumsum(-1)  # [H, n, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = decay_exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")))
    within = (q @ k.transpose(-1, -2) * decay) @ v  # [H, n, C, P]
    q_decayed = q * decay_exp(G)[..., None]
    k_to_end = k * decay_exp(G[..., -1:] - G)[..., None]
    chunk_decay = decay_exp(G[..., -1])[..., None, None]  # [H, n, 1, 1]
    out = torch.empty(heads, n, chunk, p, dtype=torch.float32, device=x.device)
    S = state.float()
    for i in range(n):
        out[:, i] = within[:, i] + q_decayed[:, i] @ S
        S = S * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v[:, i]
    return out.reshape(heads, n * chunk, p)[:, :length].transpose(0, 1), S


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token for each of S sequences: x [S, H, P], dt [S, H], A [H], B/C [S, H, N];
    ``states`` [slots, H, N, P] float32, sequence s's at ``slots[s]``, updated in place
    -> y [S, H, P] float32 without the D skip."""
    S = states[slots]
    a = (dt.float() * A.float()).exp()[..., None, None]
    S = S * a + B.float()[..., None] * (x.float() * dt.float()[..., None])[..., None, :]
    states[slots] = S
    return (S * C.float()[..., None]).sum(-2)
