"""Quality numbers from scored windows, with llama.cpp's definitions (its
``llama-perplexity`` and ``--kl-divergence``), so they read against its tables:

    perplexity        exp(mean negative log-likelihood of the scored tokens)
    KL divergence     per token, sum over the vocabulary of p_ref * (log p_ref - log p):
                      mean, median, 99th percentile (linear interpolation), max
    same top token    how often argmax p equals argmax p_ref
    delta p           p(actual next token) - p_ref(it): mean and RMS, in %
    PPL ratio         exp(mean NLL - mean NLL_ref)

(llama.cpp stores the reference's log-probabilities as 16-bit integers and skips
reference probabilities below e^-16 in the KL sum; here both are exact float32, which
differs from its figures only in digits those approximations touch.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def token_nll(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -log_probs.gather(1, targets[:, None]).squeeze(1)


@dataclass
class Scores:
    """Per-token values, gathered window by window."""

    nll: list[torch.Tensor] = field(default_factory=list)
    nll_ref: list[torch.Tensor] = field(default_factory=list)
    kld: list[torch.Tensor] = field(default_factory=list)
    same_top: list[torch.Tensor] = field(default_factory=list)

    def add(self, log_probs, targets, ref_log_probs=None) -> None:
        self.nll.append(token_nll(log_probs, targets).double())
        if ref_log_probs is None:
            return
        self.nll_ref.append(token_nll(ref_log_probs, targets).double())
        ref_probs = ref_log_probs.exp()
        self.kld.append((ref_probs * (ref_log_probs - log_probs)).sum(dim=-1).double())
        self.same_top.append(log_probs.argmax(dim=-1) == ref_log_probs.argmax(dim=-1))

    def summary(self) -> dict[str, float]:
        nll = torch.cat(self.nll)
        out = {"tokens": len(nll), "perplexity": math.exp(nll.mean().item())}
        if not self.kld:
            return out
        nll_ref, kld = torch.cat(self.nll_ref), torch.cat(self.kld)
        p_diff = (-nll).exp() - (-nll_ref).exp()
        return {
            **out,
            "perplexity_ref": math.exp(nll_ref.mean().item()),
            "perplexity_ratio": math.exp((nll.mean() - nll_ref.mean()).item()),
            "kld_mean": kld.mean().item(),
            "kld_median": kld.median().item() if len(kld) % 2 else _even_median(kld),
            "kld_p99": torch.quantile(kld, 0.99, interpolation="linear").item(),
            "kld_max": kld.max().item(),
            "same_top_pct": 100 * torch.cat(self.same_top).double().mean().item(),
            "delta_p_mean_pct": 100 * p_diff.mean().item(),
            "delta_p_rms_pct": 100 * p_diff.square().mean().sqrt().item(),
        }


def _even_median(values: torch.Tensor) -> float:
    """The mean of the two middle values (torch.median takes the lower one)."""
    ordered = values.sort().values
    middle = len(ordered) // 2
    return ((ordered[middle - 1] + ordered[middle]) / 2).item()
