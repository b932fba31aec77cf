"""Verification: which draft tokens the target accepts, and the token that follows.

For each position i the target's logits give its distribution p_i (after the request's
penalties, bans, temperature, top-k/p, min-p, with the drafts before i counted as
output). Greedy requests accept draft i while it equals argmax p_i and then take
argmax p at the first mismatch (or after the last draft: the bonus token). Sampled
requests use the rule of Leviathan et al. and Chen et al.: accept draft d with
probability min(1, p(d) / q(d)), q being the distribution the draft was drawn from
(a point mass for n-gram guesses); at the first rejection draw from
norm(max(0, p - q)); if all are accepted draw the bonus token from p. The tokens that
come out are distributed exactly as if the target had sampled them one by one.
"""

from __future__ import annotations

import torch

from tandem.runner.sampler import (
    SampledToken,
    SamplingRow,
    argmax_rows,
    draw,
    processed_logits,
    raw_logprobs_if_wanted,
    sampling_probs,
    with_logprobs,
)


def verify(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    shared_generator: torch.Generator | None,
    targets: list[int] | None = None,
) -> list[SampledToken]:
    """``logits`` [k + 1, vocab]: the target at the last token and at each draft.
    ``rows[i]`` samples position i. Returns the accepted drafts plus one token.
    ``targets``: a greedy request's argmax at each position, when the caller took them
    for many requests at once (one host sync for all, not one a request); only for rows
    whose logits nothing changes (``sampler.unprocessed``)."""
    k = len(drafts)
    raw = raw_logprobs_if_wanted(logits, rows)
    if rows[0].params.greedy:
        if targets is None:
            targets = argmax_rows(processed_logits(logits, rows)).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == targets[accepted]:
            accepted += 1
        tokens = [*drafts[:accepted], targets[accepted]]
    else:
        p = sampling_probs(processed_logits(logits, rows), rows)
        generator = rows[0].generator or shared_generator
        uniforms = torch.rand(k, generator=generator, device=p.device).tolist()
        tokens = []
        for i, draft in enumerate(drafts):
            p_draft = float(p[i, draft])
            q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
            if uniforms[i] * q_draft <= p_draft:
                tokens.append(draft)
                continue
            if draft_probs is None:
                residual = p[i].clone()
                residual[draft] = 0.0
            else:
                residual = (p[i] - draft_probs[i]).clamp_(min=0.0)
            if float(residual.sum()) <= 0:  # p == q up to rounding: nothing to correct
                residual = p[i]
            residual = residual / residual.sum()
            tokens.append(int(draw(residual[None], rows[i : i + 1], generator)[0]))
            break
        else:
            tokens.append(int(draw(p[k : k + 1], rows[k : k + 1], generator)[0]))
    used = len(tokens)
    return with_logprobs(tokens, None if raw is None else raw[:used], rows[:used])
