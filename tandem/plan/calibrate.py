"""Calibrate the step cost model on this machine: a short sweep of real engine steps
(decode batches of several sizes and contexts, prefills of several lengths, a prefill
chunk among decodes), each timed around ``Engine.step`` with its batch composition
read from the scheduler's output, then ``StepCostModel.fit``
(``tandem plan --measure --calibrate FILE``)."""

from __future__ import annotations

import platform
import tempfile
import time
from pathlib import Path

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.observer import EngineObserver
from tandem.plan.cost import ModelShape, Share, StepCostModel, shares_of
from tandem.sampling import RequestOutputKind, SamplingParams, model_sampling_defaults

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
    engine = Engine(
        EngineConfig.from_kwargs(
            str(folder), dtype=dtype, max_model_len=context,
            max_num_seqs=max(DECODE_BATCHES), enable_prefix_caching=False,
        )
    )  # fmt: skip
    observer = _Shares()
    engine.add_observer(observer)
    vocab = engine.model_info.vocab_size
    samples: list[tuple[list[Share], float]] = []
    ids = iter(range(10**9))

    def prompt(length: int) -> list[int]:
        start = next(ids)
        return [(start * 31 + 7 * i) % vocab for i in range(length)]

    # Sampled as a server samples for this model (its generation config: penalties cost
    # time per request), greedy.
    defaults = model_sampling_defaults(engine.model_info.generation_config)

    def run(prompts: list[list[int]], max_tokens: int, keep: int | None = None) -> None:
        """Run the prompts to the end; record every step (or the last ``keep``)."""
        params = SamplingParams(**{
            **defaults, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "output_kind": RequestOutputKind.FINAL_ONLY,
        })  # fmt: skip
        for p in prompts:
            engine.add_request(f"c{next(ids)}", p, params)
        timed = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            timed.append((observer.last, time.perf_counter() - start))
        samples.extend(timed if keep is None else timed[-keep:])

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
