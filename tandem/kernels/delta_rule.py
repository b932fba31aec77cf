"""The gated delta rule (Gated DeltaNet's linear attention): the recurrence a hybrid
model's linear-attention layers run (after the short convolution of
kernels/causal_conv.py), for prompts in chunked form and for decode one step at a time.

Per head, with a state S [Dk, Dv] carried from token to token::

    S_t = a_t S_{t-1} + k_t (b_t (v_t - a_t S_{t-1}^T k_t))^T      a_t = exp(g_t), g_t <= 0
    o_t = S_t^T q_t

(the state decays by a_t, then its prediction for k_t is corrected toward v_t at rate
b_t: the delta rule). The chunked form computes C tokens at once (WY representation, as
the flash-linear-attention kernels do): within a chunk, with G_i the cumulative log
decay up to token i and A = strictly_lower(diag(b) K K^T * exp(G_i - G_j)),

    T = (I + A)^-1,  U = T (b V),  W = T (b exp(G) K),  V' = U - W S
    O = (Q exp(G)) S + lower(Q K^T * exp(G_i - G_j)) V'
    S <- exp(G_C) S + (K exp(G_C - G))^T V'

so the only sequential work is one small matrix product per chunk. Everything is float32
(the states are kept in float32 whatever the model computes in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import cpu as cpu_kernels

CHUNK = 64  # tokens per chunk of the chunked form (flash-linear-attention's size)


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q/k [L, H, Dk] (normalized and scaled as the layer wants), v [L, H,
    Dv], g/beta [L, H], state [H, Dk, Dv] (float32, the state before these tokens) ->
    (o [L, H, Dv] float32, the state after them)."""
    length, heads, _ = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk
    n = (length + pad) // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, n, C, ...]
        x = x.float().transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(heads, n, chunk, *x.shape[2:])

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(-1)  # [H, n, C]; padding adds no decay (g = 0 there)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = decay_exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")))
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * decay).tril(-1)  # strictly lower
    eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
    # (I + A) is unit lower triangular: T (I + A) = I.
    T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    T = T.masked_fill(T.abs() < TINY, 0.0)  # (products of small terms: subnormal, see decay_exp)
    U = T @ (v * beta[..., None])
    from_start = decay_exp(G)[..., None]  # each token's decay since the chunk began
    W = T @ (kb * from_start)
    attn = q @ k.transpose(-1, -2) * decay  # lower, diagonal included
    q_decayed = q * from_start
    k_to_end = k * decay_exp(G[..., -1:] - G)[..., None]
    chunk_decay = decay_exp(G[..., -1])[..., None, None]  # [H, n, 1, 1]
    out = torch.empty(heads, n, chunk, dv, dtype=torch.float32, device=q.device)
    S = state.float()
    for i in range(n):
        v_new = U[:, i] - W[:, i] @ S
        out[:, i] = q_decayed[:, i] @ S + attn[:, i] @ v_new
        S = S * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, n * chunk, dv)[:, :length].transpose(0, 1)
    return out, S


# A decay below exp(-30) (1e-13) is taken as 0: its terms are far below float32's
# resolution (1e-7) of what they are added to, and their products would reach float32's
# subnormal range, where the batched matmuls run several times slower (measured: a
# 1,000-token prompt of 16 heads, 42 ms at g = -0.5 a token, 269 ms at g = -3).
EXP_FLOOR = -30.0
TINY = 1e-20  # likewise, T's entries below this (products of several decays) are 0


def decay_exp(x: torch.Tensor) -> torch.Tensor:
    """exp of log decays, those below EXP_FLOOR exactly 0."""
    return x.masked_fill(x < EXP_FLOOR, float("-inf")).exp()


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token for each of B sequences: q/k [B, H, Dk], v [B, H, Dv], g/beta [B, H];
    ``states`` [slots, H, Dk, Dv] float32, sequence b's at ``slots[b]``, updated in
    place -> o [B, H, Dv] float32. On the CPU, one compiled pass that reads each state
    twice and writes it once (delta_rule_ops.cpp)."""
    kernels = cpu_kernels.load() if cpu_kernels.enabled(states.device, states.dtype) else None
    if kernels is not None:
        args = [x.float().contiguous() for x in (q, k, v, g, beta)]
        out = torch.empty_like(args[2])
        kernels.gated_delta_step(out, *args, states, slots.contiguous())
        return out
    S = states[slots]  # [B, H, Dk, Dv]
    a = g.float().exp()[..., None, None]
    q, k, v = q.float(), k.float(), v.float()
    S = S * a
    predicted = (S * k[..., None]).sum(-2)  # S^T k: [B, H, Dv]
    delta = (v - predicted) * beta.float()[..., None]
    S = S + k[..., None] * delta[..., None, :]
    states[slots] = S
    return (S * q[..., None]).sum(-2)
