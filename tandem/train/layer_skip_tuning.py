"""``tandem tune-layer-skip``: which layers a self-speculating draft should skip.

1. Calibration text: the target answers a few varied prompts greedily (its own text is
   what its drafts will be asked to guess).
2. For each candidate set of skipped layers (early exits: every layer from L on; runs
   of consecutive layers of several widths and places; every other layer of the middle
   half), one forward over that text without those layers gives the draft's guess at
   every answer position, against the target's (teacher-forced): the agreement a.
3. The draft's cost per guess, c, is the share of a batch-1 decode step's weight bytes
   it reads (the layers it keeps, the embedding row, the LM head): decode at batch 1
   is bandwidth-bound. A step of k guesses then yields (1 - a^(k+1)) / (1 - a) tokens
   (i.i.d. acceptance) for k c + 1 decode steps' time (the verification counted as one
   step), and the best k gives each candidate's estimated speedup.

The estimate ranks candidates; what speculation actually gives on a workload is
measured by benchmarks/speculative_decoding.py (and switched off where it does not
pay: engine/spec_control.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.runner.model_runner import forward_no_cache
from tandem.spec_decode.layer_skip import format_layers, skipping

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is and when to use one.",
    "List five tips for writing clear documentation.",
    "What is the difference between a process and a thread?",
    "Summarize how HTTP caching works.",
    "Write a short story about a lighthouse keeper, in three sentences.",
]
MAX_K = 8


@dataclass(frozen=True)
class Candidate:
    layers: frozenset[int]
    agreement: float  # draft's greedy guess equals the target's, teacher-forced
    cost: float  # a guess's time, as a share of a decode step
    k: int  # the best number of guesses per step
    speedup: float  # estimated tokens per unit of time, against decoding

    @property
    def label(self) -> str:
        return format_layers(self.layers)


def candidate_sets(num_layers: int) -> list[frozenset[int]]:
    """Early exits, runs of consecutive layers, and every other middle layer."""
    sets: set[frozenset[int]] = set()
    for keep in range(max(1, num_layers // 4), num_layers, max(1, num_layers // 8)):
        sets.add(frozenset(range(keep, num_layers)))
    for width in {max(1, num_layers * w // 8) for w in (1, 2, 3, 4)}:
        for first in range(1, num_layers - width, max(1, num_layers // 6)):
            sets.add(frozenset(range(first, first + width)))
    sets.add(frozenset(range(num_layers // 4, num_layers - num_layers // 4, 2)))
    return sorted((s for s in sets if 0 < len(s) < num_layers), key=sorted)


def layer_bytes(model) -> tuple[list[int], int]:
    """Bytes of each decoder layer's weights, and of what every step reads besides
    them once per token (the LM head; the embedding row is negligible)."""

    def size(module) -> int:
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    layers = [size(layer) for layer in model.model.layers]
    return layers, size(model.lm_head) if hasattr(model, "lm_head") else 0


def estimated_speedup(agreement: float, cost: float) -> tuple[int, float]:
    """The best k (1-MAX_K) and its speedup: expected tokens per step over its time."""
    best = (1, 0.0)
    for k in range(1, MAX_K + 1):
        tokens = (1 - agreement ** (k + 1)) / (1 - agreement) if agreement < 1 else k + 1.0
        speedup = tokens / (k * cost + 1)
        if speedup > best[1]:
            best = (k, speedup)
    return best


def calibration_text(llm, num_prompts: int, num_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy answer, prompt length) for the first prompts."""
    from tandem.sampling import SamplingParams

    tokenizer = llm.engine.tokenizer
    prompts = [{"prompt_token_ids": tokenizer.encode_user_prompt(t)} for t in PROMPTS[:num_prompts]]
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
            for o in outputs]  # fmt: skip


@torch.inference_mode()
def tune(llm, num_prompts: int = 3, num_tokens: int = 64) -> list[Candidate]:
    """Every candidate set with its agreement and estimated speedup, best first."""
    loaded = llm.engine.executor.runner.loaded
    model = loaded.model
    texts = calibration_text(llm, num_prompts, num_tokens)

    def guesses(layers: frozenset[int]) -> list[torch.Tensor]:
        with skipping(model, layers):
            return [
                forward_no_cache(loaded, torch.tensor([ids], device=loaded.device))[
                    0, start - 1 : -1
                ].argmax(-1)
                for ids, start in texts
            ]

    target = guesses(frozenset())
    per_layer, fixed = layer_bytes(model)
    total = sum(per_layer) + fixed
    candidates = []
    for layers in candidate_sets(len(per_layer)):
        drafts = guesses(layers)
        agree = sum(int((d == t).sum()) for d, t in zip(drafts, target, strict=True))
        agreement = agree / sum(len(t) for t in target)
        kept = sum(b for i, b in enumerate(per_layer) if i not in layers)
        cost = (kept + fixed) / total
        k, speedup = estimated_speedup(agreement, cost)
        candidates.append(Candidate(layers, agreement, cost, k, speedup))
    return sorted(candidates, key=lambda c: -c.speedup)
