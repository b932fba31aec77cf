"""The three scheduling situations of the classic prefill/decode diagrams, measured and
drawn: the same small workload under each setting, traced step by step
(tandem.trace) and plotted as swimlanes into docs/.

Workload (bundled model, float32): four requests are decoding; a long prompt arrives;
two short prompts arrive a few steps later.

- prefill-first: the long prompt runs whole and alone; every decode waits for it;
- no chunking: the budget holds the whole prompt, so it runs in one mixed step and the
  decoders get their token only when that long step ends;
- chunked (budget 128): decodes first, the prompt fills the rest of each step's budget,
  so decoding slows a little for several steps instead of stopping.

    python -m benchmarks.scheduling_timelines [--long 768] [--out docs]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

from benchmarks.common import machine
from tandem import LLM, SamplingParams
from tandem.bench.datasets import LocalTokenizer, token_pool
from tandem.models.catalog import DEFAULT_MODEL
from tandem.trace.plot import plot_trace

SETTINGS = {
    "prefill-first": dict(scheduling_policy="prefill-first"),
    "no-chunking": dict(max_num_batched_tokens=2048),
    "chunked": dict(max_num_batched_tokens=128),
}


def run(name: str, options: dict, pool: list[int], long_len: int, trace: Path) -> dict:
    llm = LLM(str(DEFAULT_MODEL), **options)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.start_trace()
    arrivals = {
        0: [(f"decode-{i}", pool[100 * i : 100 * i + 16]) for i in range(4)],
        4: [("long", pool[1000 : 1000 + long_len])],
        7: [("short-0", pool[3000:3016]), ("short-1", pool[3100:3116])],
    }
    outputs = {}
    for step in itertools.count():
        for request_id, ids in arrivals.get(step, []):
            engine.add_request(request_id, {"prompt_token_ids": ids}, params)
        if step > max(arrivals) and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            outputs[output.request_id] = output
    llm.stop_trace(trace)
    stall = max(
        b - a
        for i in range(4)
        for a, b in itertools.pairwise(outputs[f"decode-{i}"].metrics.token_times)
    )
    return {
        "long_ttft": outputs["long"].metrics.ttft,
        "short_ttft": max(outputs[f"short-{i}"].metrics.ttft for i in range(2)),
        "stall": stall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=768)
    parser.add_argument("--out", default="docs")
    args = parser.parse_args()
    pool = token_pool(LocalTokenizer(str(DEFAULT_MODEL)), 1000 + args.long + 4000, seed=0)
    print(f"machine: {machine()}")
    print(f"{'setting':<15}{'long TTFT':>10}{'short TTFT':>11}{'worst decode gap':>18}  (ms)")
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in SETTINGS.items():
            trace = Path(tmp) / f"{name}.json"
            run(name, options, pool, args.long, trace)  # warm-up (kernel build, caches)
            figures = run(name, options, pool, args.long, trace)
            picture = plot_trace(
                trace,
                Path(args.out) / f"timeline-{name}.png",
                title=f"{name}: 4 decoding, a {args.long}-token prompt arrives, then 2 short",
            )
            print(
                f"{name:<15}{figures['long_ttft'] * 1e3:>10.1f}{figures['short_ttft'] * 1e3:>11.1f}"
                f"{figures['stall'] * 1e3:>18.1f}  -> {picture}"
            )


if __name__ == "__main__":
    main()
