"""The training loop: tandem's own no-cache forward, AdamW, warmup + cosine schedule.

Deterministic given the seed (the batch sampler and the model init draw from their own
generators), with a progress bar showing loss and tokens/s. With ``checkpoint`` set it
saves model, optimizer, step and sampler state every ``checkpoint_every`` steps and at
the end, and resumes from that file if it exists: a resumed run ends where an
uninterrupted one would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from tandem.models.loader import LoadedModel
from tandem.runner.model_runner import forward_no_cache


@dataclass
class TrainConfig:
    steps: int
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    seed: int = 0
    checkpoint_every: int = 100


def learning_rate(config: TrainConfig, step: int) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def random_windows(tokens: torch.Tensor, config: TrainConfig, generator: torch.Generator):
    """A batch of (input, target) windows at random offsets of the token stream."""
    starts = torch.randint(
        0, len(tokens) - config.seq_len - 1, (config.batch_size,), generator=generator
    )
    rows = torch.stack([tokens[s : s + config.seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def train(
    loaded: LoadedModel,
    tokens: torch.Tensor,
    config: TrainConfig,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    stop_at: int | None = None,
) -> list[float]:
    """Train ``loaded.model`` in place on a 1-D token stream; returns each step's loss.

    ``stop_at``: end after that step, checkpointed, as an interruption would (the
    schedule still spans ``config.steps``; call again to continue)."""

    def loss(generator: torch.Generator) -> torch.Tensor:
        inputs, targets = random_windows(tokens, config, generator)
        logits = forward_no_cache(loaded, inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    loaded.model.requires_grad_(True)
    tokens_per_step = config.batch_size * config.seq_len
    return fit(loaded.model, config, loss, tokens_per_step, checkpoint, progress, stop_at)


LossFn = Callable[[torch.Generator], torch.Tensor]


def fit(
    model: nn.Module,
    config: TrainConfig,
    loss_fn: LossFn,
    tokens_per_step: int,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    stop_at: int | None = None,
) -> list[float]:
    """The loop itself: ``loss_fn(generator)`` draws a batch from the generator and
    returns its loss; the trainable parameters of ``model`` (those that require a
    gradient once it is in training mode; frozen ones are left alone) follow it."""
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.dim() >= 2]
    no_decay = [p for n, p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(config.seed)
    start_step, losses, seconds_before, segments = 0, [], 0.0, []
    checkpoint = Path(checkpoint) if checkpoint else None
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        start_step, losses = state["step"], state["losses"]
        seconds_before, segments = state["seconds"], state["segments"]
    end = config.steps if stop_at is None else min(stop_at, config.steps)
    bar = tqdm(
        range(start_step, end),
        initial=start_step,
        total=config.steps,
        disable=not progress,
    )
    started = time.perf_counter()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        loss = loss_fn(generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        optimizer.step()
        losses.append(loss.item())
        done = step + 1 - start_step
        rate = done * tokens_per_step / (time.perf_counter() - started)
        bar.set_postfix_str(f"loss {losses[-1]:.3f}, {rate:,.0f} tok/s")
        if checkpoint is not None and (
            step + 1 == end or (step + 1) % config.checkpoint_every == 0
        ):
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "generator": generator.get_state(),
                    "step": step + 1,
                    "losses": losses,
                    # Cumulative training time, and each run as (first step, last step,
                    # schedule length): a run extended with more steps says so.
                    "seconds": seconds_before + time.perf_counter() - started,
                    "segments": [*segments, (start_step, step + 1, config.steps)],
                },
                checkpoint,
            )
    model.eval().requires_grad_(False)
    return losses
