"""Batched sampling: one pass over the [S, vocab] logits of the requests that sample.

Order, as vLLM: logprobs of the raw distribution are taken first; then penalties
(repetition over prompt + output, presence and frequency over the output), the
min_tokens ban on stop tokens, temperature, top-k, top-p, min-p. All-greedy batches
are a plain argmax. Sampling uses the exponential-noise trick
(``argmax(p / Exp(1))`` draws from p) so no row needs a host sync, and a row with a
seed draws its noise from its own generator, so its tokens do not depend on which
other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.runner.host_to_device import to_device
from tandem.sampling import SamplingParams


@dataclass
class PenaltyCounts:
    """A request's token counts for penalties, kept up to date as its tokens arrive
    (input_batch.py) instead of rebuilt from the whole history every step."""

    output_counts: torch.Tensor  # [vocab] float32: times each token was generated
    prompt_seen: torch.Tensor  # [vocab] bool: in the prompt (repetition penalty)
    num_counted: int = 0  # output tokens included in output_counts

    @classmethod
    def of(cls, prompt: list[int], output: list[int], vocab: int, device) -> PenaltyCounts:
        counts = cls(
            torch.zeros(vocab, device=device), torch.zeros(vocab, dtype=torch.bool, device=device)
        )
        if prompt:
            counts.prompt_seen[to_device(prompt, device).clamp_(max=vocab - 1)] = True
        counts.add(output)
        return counts

    def add(self, token_ids: list[int]) -> None:
        if token_ids:
            vocab = self.output_counts.shape[0]
            ids = to_device(token_ids, self.output_counts.device).clamp_(max=vocab - 1)
            self.output_counts.index_add_(0, ids, torch.ones(len(ids), device=ids.device))
            self.num_counted += len(token_ids)


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # the request's own, when it has a seed
    banned_token_ids: tuple[int, ...] = ()  # eos/stop ids while below min_tokens
    # Counts kept by the runner for the first ``num_counted`` output tokens (the rest,
    # drafts being verified, are counted here); None: count from the lists.
    penalty_counts: PenaltyCounts | None = None


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the chosen token, under the raw distribution
    top_logprobs: list[tuple[int, float]] | None = None  # best first


def _column(rows: list[SamplingRow], name: str, device, dtype=torch.float32) -> torch.Tensor:
    return to_device([getattr(r.params, name) for r in rows], device, dtype)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    presence = _column(rows, "presence_penalty", device)
    frequency = _column(rows, "frequency_penalty", device)
    repetition = _column(rows, "repetition_penalty", device)
    counts = torch.zeros_like(logits)
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        # The runner's kept counts, or counts made here for a row that has none.
        kept = row.penalty_counts or PenaltyCounts.of(row.prompt_token_ids, [], vocab, device)
        counts[i] = kept.output_counts
        if row.params.repetition_penalty != 1.0:
            seen[i] = kept.prompt_seen
        uncounted = row.output_token_ids[kept.num_counted :]  # (drafts being verified)
        if uncounted:
            ids = to_device(uncounted, device).clamp_(max=vocab - 1)
            counts[i].index_add_(0, ids, torch.ones(len(ids), device=device))
    seen |= counts > 0
    # Repetition penalty (CTRL): shrink positive logits, push negative ones further down.
    penalised = torch.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None])
    logits = torch.where(seen, penalised, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution sampled rows draw from (temperature, top-k, top-p, min-p),
    given already-penalised logits. Greedy rows get temperature 1 here and are
    decided by argmax instead."""
    device, vocab = logits.device, logits.shape[1]
    temperature = to_device([r.params.temperature or 1.0 for r in rows], device, torch.float32)
    logits = logits / temperature[:, None]
    # Clamped in Python: a client's top_k may not fit an int64 (2^63 did).
    top_k = to_device(
        [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows], device
    )
    top_p = _column(rows, "top_p", device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    remove = rank >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs_sorted = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    remove |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(r.params.min_p > 0 for r in rows):  # (decided on the host: no sync)
        min_p = _column(rows, "min_p", device)
        too_small = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(too_small, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def processed_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalties, logit biases and the min_tokens ban applied: the logits greedy rows
    take the argmax of and sampled rows turn into probabilities (``sampling_probs``)."""
    banning = any(r.banned_token_ids for r in rows)
    biased = any(r.params.logit_bias for r in rows)
    if any(needs_penalties(r.params) for r in rows):
        logits = apply_penalties(logits, rows)
    elif banning or biased:
        logits = logits.clone()  # the caller's logits stay as they were
    if biased:
        rows_index, tokens, values = [], [], []
        for i, row in enumerate(rows):
            for token, bias in (row.params.logit_bias or {}).items():
                rows_index.append(i)
                tokens.append(token)
                values.append(bias)
        device = logits.device
        logits.index_put_(
            (to_device(rows_index, device), to_device(tokens, device)),
            to_device(values, device, logits.dtype),
            accumulate=True,
        )
    if banning:
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, to_device(list(row.banned_token_ids), logits.device)] = float("-inf")
    return logits


def draw(
    probs: torch.Tensor, rows: list[SamplingRow], shared_generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row from ``probs`` [S, vocab]: argmax(p / Exp(1)), no host sync.
    Unseeded rows share one batched draw; seeded rows draw from their own generator."""
    noise = torch.empty_like(probs).exponential_(generator=shared_generator)
    for i, row in enumerate(rows):
        if row.generator is not None and not row.params.greedy:
            noise[i].exponential_(generator=row.generator)
    return (probs / noise).argmax(dim=-1)


def with_logprobs(
    tokens: list[int], raw_logprobs: torch.Tensor | None, rows: list[SamplingRow]
) -> list[SampledToken]:
    """SampledTokens, with the raw-distribution logprobs of rows that asked for them."""
    if raw_logprobs is None:
        return [SampledToken(t) for t in tokens]
    return scored_tokens(tokens, raw_logprobs, [r.params.logprobs for r in rows])


def scored_tokens(
    tokens: list[int], log_probs: torch.Tensor, top_k: list[int | None]
) -> list[SampledToken]:
    """Each row's token with its log-probability and the row's ``top_k[i]`` best
    (None: neither): ``log_probs`` [N, vocab] normalised."""
    results = [SampledToken(t) for t in tokens]
    num_logprobs = max((k or 0) for k in top_k)
    index = to_device(tokens, log_probs.device)[:, None]
    chosen = log_probs.gather(1, index).flatten().tolist()
    top_values, top_ids = log_probs.topk(max(num_logprobs, 1), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for i, k in enumerate(top_k):
        if k is None:
            continue
        results[i].logprob = chosen[i]
        results[i].top_logprobs = list(zip(top_ids[i][:k], top_values[i][:k], strict=True))
    return results


def raw_logprobs_if_wanted(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
    if any(r.params.logprobs is not None for r in rows):
        return logits.log_softmax(dim=-1)
    return None


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    shared_generator: torch.Generator | None = None,
) -> list[SampledToken]:
    """logits [S, vocab] float32, one row per request that samples this step."""
    raw_logprobs = raw_logprobs_if_wanted(logits, rows)
    logits = processed_logits(logits, rows)
    tokens = argmax_rows(logits)
    greedy_flags = [r.params.greedy for r in rows]
    if not all(greedy_flags):
        greedy = to_device(greedy_flags, logits.device)
        sampled = draw(sampling_probs(logits, rows), rows, shared_generator)
        tokens = torch.where(greedy, tokens, sampled)
    return with_logprobs(tokens.tolist(), raw_logprobs, rows)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[S, vocab] -> [S] token ids: the compiled scan on CPU (several times torch's
    argmax over a batch of logits), torch elsewhere."""
    fits = logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype == torch.float32
    if fits and cpu_kernels.usable(logits):
        out = torch.empty(logits.shape[0], dtype=torch.long)
        cpu_kernels.load().argmax_rows(out, logits)
        return out
    return logits.argmax(dim=-1)


def unprocessed(row: SamplingRow) -> bool:
    """``processed_logits`` leaves this row's logits as they are."""
    return not (needs_penalties(row.params) or row.params.logit_bias or row.banned_token_ids)


def needs_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0
        or params.frequency_penalty != 0
        or params.repetition_penalty != 1.0
    )
