"""Calibrate the step cost model on this machine, two ways:

- a short sweep of real engine steps (decode batches of several sizes and contexts,
  prefills of several lengths), each timed around ``Engine.step`` with its batch
  composition read from the scheduler's output, then ``StepCostModel.fit``
  (``tandem plan --measure --calibrate FILE``): the engine alone;
- the steps of a serving run's trace (``fit_trace``: `tandem serve`'s /trace, under
  a load like the one to predict; ``tandem plan --calibrate FILE --from-trace T``):
  each step costs its whole cycle, from its start to the next step's start while the
  engine stays busy, so the core's work between steps and the contention with the
  HTTP server and the clients are in it. Given the clients' mean TTFT of that run, the
  time a request spends outside the engine is fitted too (``frontend_s``).
"""

from __future__ import annotations

import dataclasses
import itertools
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.observer import EngineObserver
from tandem.executor import make_executor
from tandem.plan.cost import ModelShape, Share, StepCostModel, shares_of
from tandem.sampling import RequestOutputKind, SamplingParams, model_sampling_defaults
from tandem.trace.recorder import ENGINE_PID

# A gap between two steps longer than this: the engine idled (no work), and the cycle
# of the step before it is not a cost.
BUSY_GAP_S = 2e-3

DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_CONTEXTS = (32, 256)
PREFILL_LENGTHS = (16, 64, 256, 1024)
DECODE_STEPS = 6  # timed per decode setting, after its prefill


class _Shares(EngineObserver):
    """The composition of the step that just ran."""

    def __init__(self) -> None:
        self.last: list[Share] = []

    def step_done(self, out, stats) -> None:
        if out is not None:
            self.last = shares_of(out.scheduled)


class TimedSteps:
    """An engine driven to the end of what it is given, each step timed with its
    composition: distinct synthetic prompts of token ids (no prefix shared), greedy,
    sampled as a server samples for the model (its generation config: penalties cost
    time per request). The calibration sweep and the plan's fixed cost of a step
    (fixed_cost.py) both time steps this way."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.shares = _Shares()
        engine.add_observer(self.shares)
        self.vocab = engine.model_info.vocab_size
        self.defaults = model_sampling_defaults(engine.model_info.generation_config)
        self.ids = iter(range(10**9))

    def prompt(self, length: int) -> list[int]:
        start = next(self.ids)
        return [(start * 31 + 7 * i) % self.vocab for i in range(length)]

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[Share], float]]:
        """Run the prompts to the end: every step's shares and seconds."""
        params = SamplingParams(**{
            **self.defaults, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "output_kind": RequestOutputKind.FINAL_ONLY,
        })  # fmt: skip
        for p in prompts:
            self.engine.add_request(f"c{next(self.ids)}", p, params)
        timed = []
        while self.engine.has_unfinished_requests():
            start = time.perf_counter()
            self.engine.step()
            timed.append((self.shares.last, time.perf_counter() - start))
        return timed


def calibrate(
    config_path: str | Path, shape: ModelShape, dtype: str, max_model_len: int
) -> tuple[StepCostModel, list[tuple[list[Share], float]]]:
    """Fit the cost model to timed steps of the model at ``config_path`` (its weights
    if the folder has them, else random ones) in ``dtype`` (float32 / bfloat16)."""
    folder = Path(config_path)
    if folder.is_dir() and any(folder.glob("*.safetensors")):
        return _calibrate_folder(folder, shape, dtype, max_model_len)
    with tempfile.TemporaryDirectory(prefix="tandem-calibrate-") as scratch:
        return _calibrate_folder(_random_folder(folder, scratch), shape, dtype, max_model_len)


def _random_folder(config_path: Path, scratch: str) -> Path:
    import json

    from tandem.models.random_weights import random_model
    from tandem.models.saver import save_pretrained

    raw = json.loads((config_path / "config.json" if config_path.is_dir() else config_path)
                     .read_text())  # fmt: skip
    return save_pretrained(random_model(raw).model, raw, Path(scratch) / "model")


def _calibrate_folder(folder: Path, shape: ModelShape, dtype: str, max_model_len: int):
    longest = max(max(PREFILL_LENGTHS), max(DECODE_CONTEXTS)) + DECODE_STEPS + 8
    context = min(max_model_len, longest)
    config = EngineConfig.from_kwargs(
        str(folder), dtype=dtype, max_model_len=context,
        max_num_seqs=max(DECODE_BATCHES), enable_prefix_caching=False,
    )  # fmt: skip
    engine = Engine(config, make_executor(config))
    steps = TimedSteps(engine)
    samples: list[tuple[list[Share], float]] = []

    def run(prompts: list[list[int]], max_tokens: int, keep: int | None = None) -> None:
        """Run the prompts to the end; record every step (or the last ``keep``)."""
        timed = steps.run(prompts, max_tokens)
        samples.extend(timed if keep is None else timed[len(timed) - keep :])

    prompt = steps.prompt
    run([prompt(64)], 4, keep=0)  # warm up: page faults, kernel caches
    for length in PREFILL_LENGTHS:
        if length < context:  # (a short context leaves the longest out)
            run([prompt(length)], 1)
    for cached in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            if cached + DECODE_STEPS + 1 <= context:
                run([prompt(cached) for _ in range(batch)], DECODE_STEPS + 1, keep=DECODE_STEPS)
    engine.kv_manager.check_no_leaks()
    source = f"fitted to {len(samples)} steps on {platform.node() or 'this machine'}"
    return StepCostModel.fit(shape, samples, source), samples


def fit_trace(
    shape: ModelShape, trace: dict[str, Any], client_mean_ttft_s: float | None = None
) -> tuple[StepCostModel, list[tuple[list[Share], float]]]:
    """Fit the cost model to the busy step cycles of a serving run's Chrome trace
    (tandem.trace). ``client_mean_ttft_s``: the mean TTFT its clients measured, for
    ``frontend_s`` (``frontend_seconds``)."""
    samples = trace_samples(trace)
    source = f"fitted to {len(samples)} served steps on {platform.node() or 'this machine'}"
    model = StepCostModel.fit(shape, samples, source)
    if client_mean_ttft_s is not None:
        model = dataclasses.replace(model, frontend_s=frontend_seconds(trace, client_mean_ttft_s))
    return model, samples


def trace_samples(trace: dict[str, Any]) -> list[tuple[list[Share], float]]:
    """(shares, seconds) of each step of a trace that the engine followed with another
    at once: its cycle, from its start to the next one's."""
    steps = sorted(
        (e for e in trace.get("traceEvents", [])
         if e.get("cat") == "step" and e.get("pid") == ENGINE_PID),
        key=lambda e: e["ts"],
    )  # fmt: skip
    samples = []
    for step, after in itertools.pairwise(steps):
        if "shares" not in step["args"]:
            raise ValueError("the trace has no step compositions (recorded by an older tandem)")
        cycle = (after["ts"] - step["ts"]) / 1e6
        idle = (after["ts"] - step["ts"] - step["dur"]) / 1e6
        if idle <= BUSY_GAP_S and step["args"]["shares"]:
            samples.append(([tuple(share) for share in step["args"]["shares"]], cycle))
    return samples


def frontend_seconds(trace: dict[str, Any], client_mean_ttft_s: float) -> float:
    """A request's time outside the engine: the clients' mean TTFT less the engine's
    (arrival at the engine to first token) over the same requests. Take it from a run
    below saturation: past it, requests also queue in front of the engine."""
    engine_ttfts = [
        e["args"]["ttft_ms"] / 1e3
        for e in trace.get("traceEvents", [])
        if e.get("name") == "first token"
    ]
    if not engine_ttfts:
        raise ValueError("the trace has no first tokens")
    return max(client_mean_ttft_s - statistics.fmean(engine_ttfts), 0.0)
