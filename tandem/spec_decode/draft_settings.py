"""The settings of ``tandem train-draft`` (train/draft_head.py), importable
without torch (the command line reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftTraining:
    prompts: int = 3200
    heldout_prompts: int = 48
    max_tokens: int = 160  # per answer
    seq_len: int = 384  # prompt + answer, truncated
    draft_vocab_size: int = 8192
    steps: int = 1200
    batch_size: int = 8
    lr: float = 1e-3
    feature_noise: float = 0.05  # std of the input noise, relative to a feature's RMS
    regression_weight: float = 1.0
    # Matmuls in bfloat16 (autocast; weights and the optimizer stay float32): 1.5-2x
    # faster on a CPU with AVX-512 bf16 units, and tens of times slower on one without
    # (torch emulates them). None: where the CPU has them (kernels/cpu.py).
    bf16: bool | None = None
    seed: int = 0
