"""The seed's three scheduling pictures as numbers.

8 requests are decoding when a long prompt arrives, and a short one right behind it.
For each scheduling setting we report the short request's TTFT, the long one's TTFT,
and the decoders' worst and p99 inter-token gap while the long prompt is processed,
next to a normal decode step:

- ``prefill-first``: prompts run whole and every decode waits (a stall as long as the
  whole prefill);
- ``no chunking``: the budget holds the whole prompt, so it runs in one mixed step with
  the decodes (the same stall, but the decoders do get a token from that step);
- ``chunked, budget B``: decodes first, the prompt fills the rest of a B-token budget;
- ``budget B, cap C``: the same with ``long_prefill_token_threshold=C``, so the long
  prompt takes at most C tokens a step and the short one starts beside it.

    python -m benchmarks.scheduling_policies [--long 2000] [--budgets 16 32 64 128 256]
"""

from __future__ import annotations

import argparse
import itertools
import statistics

from benchmarks.common import llama_125m_folder, machine
from tandem import LLM, SamplingParams

NUM_DECODERS = 8


def scenario(folder, long_len: int, short_len: int, **options) -> dict[str, float]:
    llm = LLM(str(folder), max_num_seqs=16, **options)
    engine = llm.engine
    decode = SamplingParams(temperature=0, max_tokens=2000 - 64, ignore_eos=True)
    for i in range(NUM_DECODERS):
        engine.add_request(
            f"d{i}", {"prompt_token_ids": [(5 * i + j) % 32000 for j in range(64)]}, decode
        )
    for _ in range(12):  # all decoders past their prompt, steady decoding
        engine.step()
    engine.add_request(
        "long",
        {"prompt_token_ids": [(3 * j) % 32000 for j in range(long_len)]},
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    # The short prompt arrives right behind the long one, before the next step.
    engine.add_request(
        "short",
        {"prompt_token_ids": list(range(100, 100 + short_len))},
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    finished: dict[str, object] = {}
    latest: dict[str, object] = {}
    while not {"long", "short"} <= finished.keys():
        for output in engine.step():
            latest[output.request_id] = output
            if output.finished:
                finished[output.request_id] = output
    long_metrics = finished["long"].metrics
    window_start = long_metrics.arrival_time
    window_end = long_metrics.first_token_time
    gaps, normal = [], []
    for i in range(NUM_DECODERS):
        times = latest[f"d{i}"].metrics.token_times
        for a, b in itertools.pairwise(times):
            if b < window_start:
                normal.append(b - a)
            elif a <= window_end:
                gaps.append(b - a)
    engine.abort([f"d{i}" for i in range(NUM_DECODERS)])
    gaps.sort()
    return {
        "normal": statistics.median(normal),
        "median_gap": statistics.median(gaps),
        "max_gap": gaps[-1],
        "p99_gap": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "short_ttft": finished["short"].metrics.ttft,
        "long_ttft": long_metrics.ttft,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=2000)
    parser.add_argument("--short", type=int, default=32)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (medians)")
    args = parser.parse_args()
    folder = llama_125m_folder()
    settings = [
        (
            "prefill-first",
            dict(scheduling_policy="prefill-first", max_num_batched_tokens=args.long + 64),
        )
    ]
    settings.append(("no chunking", dict(max_num_batched_tokens=args.long + 64)))
    settings += [(f"chunked, budget {b}", dict(max_num_batched_tokens=b)) for b in args.budgets]
    # A cap on one request's chunk leaves budget for prompts that arrive behind it.
    settings.append(
        ("budget 256, cap 32", dict(max_num_batched_tokens=256, long_prefill_token_threshold=32))
    )
    print(f"machine: {machine()}")
    print(
        f"{NUM_DECODERS} decoders; a {args.long}-token prompt arrives, "
        f"then a {args.short}-token one\n"
    )
    print(f"median of {args.repeats} runs per setting; gaps are the decoders' while the long")
    print("prompt is being processed, 'normal' is their median step before it arrived\n")
    print(
        f"{'setting':<22}{'normal':>8}{'median gap':>12}{'p99 gap':>9}{'max gap':>9}"
        f"{'max/normal':>11}{'short TTFT':>12}{'long TTFT':>11}"
    )
    for name, options in settings:
        runs = [scenario(folder, args.long, args.short, **options) for _ in range(args.repeats)]
        r = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(
            f"{name:<22}{r['normal'] * 1e3:>6.0f}ms{r['median_gap'] * 1e3:>10.0f}ms"
            f"{r['p99_gap'] * 1e3:>7.0f}ms{r['max_gap'] * 1e3:>7.0f}ms"
            f"{r['max_gap'] / r['normal']:>10.1f}x{r['short_ttft'] * 1e3:>10.0f}ms"
            f"{r['long_ttft']:>10.2f}s"
        )


if __name__ == "__main__":
    main()
