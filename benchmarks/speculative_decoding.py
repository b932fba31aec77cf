"""Speculative decoding on the bundled pair (stdlib-lm, stdlib-lm-draft): TPOT and
throughput at several batch sizes, without speculation, with n-gram lookup and with the
draft model, on two workloads:

- held-out code: 256-token windows of stdlib files the models never saw, continued
  greedily (code repeats itself: n-gram lookup has something to find);
- code, penalized: the same, with the bundled model's recommended repetition penalty
  (1.3), which steers the target away from the repeats n-gram lookup proposes;
- free generation: 8-token openers of the same files, sampled (temperature 0.8,
  top-p 0.95, seeded): the model's own text, less predictable.

Beside each: the acceptance rate a, the mean acceptance length (tokens per
verification) and the formula's expectation (1 - a^(k+1)) / (1 - a) for i.i.d.
acceptance. Speculation is forced on at every batch size here (disable_by_batch_size
off) to show where it stops paying.

    python -m benchmarks.speculative_decoding [--batches 1 4 8 16] [--k 4] [--repeats 3]
        [--methods ngram draft] [--workloads "held-out code" "free generation"]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import machine
from tandem import LLM, SamplingParams
from tandem.models.bundled import DEFAULT_MODEL
from tandem.models.tokenizer import Tokenizer
from tandem.train.corpus import split, stdlib_root, stdlib_sources

OUTPUT_TOKENS = 128


def heldout_prompts(count: int, length: int) -> list[list[int]]:
    tokenizer = Tokenizer(DEFAULT_MODEL)
    _, heldout = split(stdlib_sources(stdlib_root()))
    prompts = []
    for source in heldout:
        ids = tokenizer.encode(source.text)
        if len(ids) >= length + OUTPUT_TOKENS:
            start = len(ids) // 3  # past the imports and the module docstring
            prompts.append(ids[start : start + length])
        if len(prompts) == count:
            return prompts
    raise RuntimeError("not enough held-out files")


WORKLOADS = {
    "held-out code": dict(
        length=256, params=dict(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    ),
    # The bundled model's recommended sampling: greedy with a repetition penalty, which
    # steers away from the repeats n-gram lookup proposes.
    "code, penalized": dict(
        length=256,
        params=dict(
            temperature=0.0, repetition_penalty=1.3, max_tokens=OUTPUT_TOKENS, ignore_eos=True
        ),
    ),
    "free generation": dict(
        length=8,
        params=dict(temperature=0.8, top_p=0.95, max_tokens=OUTPUT_TOKENS, ignore_eos=True),
    ),
}


def measure(llm: LLM, prompts: list[list[int]], params: dict, seed: int) -> dict[str, float]:
    before = llm.engine.spec_stats.copy()
    sampling = [SamplingParams(**params, seed=seed + i) for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    elapsed = time.perf_counter() - start
    run = llm.engine.spec_stats.minus(before)
    return {
        "tpot": statistics.median(o.metrics.tpot for o in outputs),
        "throughput": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
        "acceptance": run.acceptance_rate,
        "length": run.mean_acceptance_length or 1.0,
    }


def expected_length(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    args = parser.parse_args()
    print(f"machine: {machine()}; bundled pair, float32, {OUTPUT_TOKENS} output tokens, "
          f"k = {args.k}, medians of {args.repeats}")  # fmt: skip
    settings = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
        "draft": {"method": "draft", "num_speculative_tokens": args.k},
    }
    engines = {}
    for name, spec in settings.items():
        if name != "none" and name not in args.methods:
            continue
        if spec is not None:
            spec = {**spec, "disable_by_batch_size": None}
        engines[name] = LLM(str(DEFAULT_MODEL), speculative_config=spec)
    workloads = {name: WORKLOADS[name] for name in args.workloads}
    prompts = {
        name: heldout_prompts(max(args.batches), workload["length"])
        for name, workload in workloads.items()
    }
    print(
        f"{'workload':<16}{'batch':>6}{'method':>7}{'TPOT ms':>9}{'speedup':>8}{'tok/s':>8}"
        f"{'x none':>7}{'accept':>8}{'len':>6}{'formula':>8}"
    )
    for workload, spec in workloads.items():
        for batch in args.batches:
            rows = {}
            for name, llm in engines.items():
                measure(llm, prompts[workload][:batch], spec["params"], seed=0)  # warm up
                runs = [
                    measure(llm, prompts[workload][:batch], spec["params"], seed=r)
                    for r in range(args.repeats)
                ]
                rows[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            base = rows["none"]
            for name, r in rows.items():
                spec_cols = (
                    f"{r['acceptance']:>8.0%}{r['length']:>6.2f}"
                    f"{expected_length(r['acceptance'], args.k):>8.2f}"
                    if name != "none"
                    else ""
                )
                print(
                    f"{workload:<16}{batch:>6}{name:>7}{r['tpot'] * 1e3:>9.2f}"
                    f"{base['tpot'] / r['tpot']:>7.2f}x{r['throughput']:>8.0f}"
                    f"{r['throughput'] / base['throughput']:>6.2f}x" + spec_cols
                )


if __name__ == "__main__":
    main()
