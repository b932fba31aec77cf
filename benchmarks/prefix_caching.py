"""Prefix caching on and off, same server settings, two workloads through
`tandem bench serve` against `tandem serve` on the bundled model:

- prefix-repetition: 8 shared prefixes of 512 tokens, a unique 64-token suffix each,
  128 output tokens (the issue's workload);
- multi-turn chat replay: conversations whose every turn resends the history (a
  shared system prompt, then user and assistant turns), replayed turn by turn.

    python -m benchmarks.prefix_caching [--num-prompts 64] [--request-rate 4] [--repeats 3]
        [--server-args "--threads 1"]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import machine
from tandem.bench.datasets import LocalTokenizer, token_pool
from tandem.bench.serve import add_arguments, run
from tandem.models.catalog import DEFAULT_MODEL
from tandem.server.launch import tandem_process


def chat_replay_file(
    path: Path, conversations: int, turns: int, system_len: int, turn_len: int, seed: int
) -> int:
    """A JSONL replay: turn t of every conversation, then turn t + 1, ... Each prompt is
    the shared system prompt plus the conversation so far (token ids, exact)."""
    tokenizer = LocalTokenizer(str(DEFAULT_MODEL))
    pool = token_pool(tokenizer, system_len + 2 * turns * conversations * turn_len, seed)
    rng = random.Random(seed)
    system = pool[:system_len]

    def piece() -> list[int]:
        start = rng.randrange(system_len, len(pool) - turn_len)
        return pool[start : start + turn_len]

    histories = [list(system) for _ in range(conversations)]
    lines = []
    for _ in range(turns):
        for history in histories:
            history += piece()  # the user's turn
            lines.append({"prompt": list(history), "output_len": turn_len})
            history += piece()  # the assistant's reply, as recorded
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return len(lines)


def bench(base_url: str, flags: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--base-url", base_url, "--tokenizer", str(DEFAULT_MODEL), "--ignore-eos",
         "--no-progress", *flags]
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        return run(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (seeds differ)")
    parser.add_argument("--server-args", default="", help='extra flags, e.g. "--threads 1"')
    options = parser.parse_args()
    print(f"machine: {machine()}")
    print(
        f"bundled model, float32, Poisson arrivals at {options.request_rate:g} req/s, "
        f"server flags: {options.server_args or '(defaults)'}; medians of {options.repeats} "
        "runs, each with its own prefixes and conversations (seed = run index)"
    )
    print(
        f"{'workload':<19}{'cache':>6}{'mean TTFT':>10}{'p99 TTFT':>10}{'out tok/s':>10}"
        f"{'hit rate':>9}   (TTFT in ms)"
    )
    results: dict[tuple[str, bool], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cache in (False, True):
            flag = "--enable-prefix-caching" if cache else "--no-enable-prefix-caching"
            server = ["serve", "--model", "stdlib-lm", flag, "--log-level", "warning",
                      *options.server_args.split()]  # fmt: skip
            with tandem_process(*server) as base_url:
                for seed in range(options.repeats):
                    for name, flags in workloads(Path(tmp), options, seed).items():
                        args = [*flags, "--request-rate", str(options.request_rate)]
                        summary = bench(base_url, [*args, "--seed", str(seed)])
                        results.setdefault((name, cache), []).append(summary)
            for name in ("prefix-repetition", "multi-turn chat"):
                runs = results[name, cache]
                print(
                    f"{name:<19}{'on' if cache else 'off':>6}"
                    f"{median(runs, 'mean_ttft_ms'):>10.1f}{median(runs, 'p99_ttft_ms'):>10.1f}"
                    f"{median(runs, 'output_throughput'):>10.0f}"
                    f"{100 * median(runs, 'prefix_cache_hit_rate'):>8.1f}%"
                    + (f"  ({sum(r['failed'] for r in runs)} failed)" if any(
                        r["failed"] for r in runs) else "")
                )  # fmt: skip
    for name in ("prefix-repetition", "multi-turn chat"):
        off, on = results[name, False], results[name, True]
        ratios = sorted(a["mean_ttft_ms"] / b["mean_ttft_ms"] for a, b in zip(off, on, strict=True))
        print(
            f"{name}: mean TTFT {median(off, 'mean_ttft_ms') / median(on, 'mean_ttft_ms'):.2f}x "
            f"lower with the cache (per-run ratios {', '.join(f'{r:.2f}' for r in ratios)}), "
            f"p99 {median(off, 'p99_ttft_ms') / median(on, 'p99_ttft_ms'):.2f}x"
        )


def median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def workloads(tmp: Path, options: argparse.Namespace, seed: int) -> dict[str, list[str]]:
    replay = tmp / f"chat-{seed}.jsonl"
    num_turns = chat_replay_file(replay, 16, 4, 128, 64, seed)
    return {
        "prefix-repetition": [
            "--dataset", "prefix-repetition", "--num-prompts", str(options.num_prompts),
            "--prefix-repetition-prefix-len", "512", "--prefix-repetition-suffix-len", "64",
            "--prefix-repetition-num-prefixes", "8", "--prefix-repetition-output-len", "128",
        ],
        "multi-turn chat": [
            "--dataset", "jsonl", "--dataset-path", str(replay), "--num-prompts", str(num_turns),
        ],
    }  # fmt: skip


if __name__ == "__main__":
    main()
