"""`tandem bench serve` against `tandem serve` on the bundled model: request rates up
to saturation, under each scheduling policy, with the offline engine on the same
requests as the yardstick for throughput (what the engine does with no HTTP, no
arrivals, everything queued at once).

    python -m benchmarks.serving [--num-prompts 32] [--rates 2,4,8,16,inf]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import time

from benchmarks.common import machine
from tandem import LLM, SamplingParams
from tandem.bench.datasets import LocalTokenizer, random_requests
from tandem.bench.serve import add_arguments, run
from tandem.models.bundled import DEFAULT_MODEL
from tandem.server.launch import tandem_process

SETTINGS = {
    "chunked, budget 2048": ["--scheduling-policy", "chunked"],
    "chunked, budget 256": ["--scheduling-policy", "chunked", "--max-num-batched-tokens", "256"],
    "prefill-first": ["--scheduling-policy", "prefill-first"],
}


def offline_throughput(num_prompts: int, input_len: int, output_len: int, seed: int) -> float:
    requests = random_requests(
        LocalTokenizer(str(DEFAULT_MODEL)), num_prompts, input_len, output_len, 0.0, seed
    )
    llm = LLM(str(DEFAULT_MODEL))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rates", default="2,4,8,16,inf")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    rates = [float(r) for r in options.rates.split(",")]
    print(f"machine: {machine()}")
    print(
        f"workload: {options.num_prompts} requests, {options.input_len} prompt tokens, "
        f"{options.output_len} output tokens (ignore_eos), bundled model, float32"
    )
    offline = offline_throughput(
        options.num_prompts, options.input_len, options.output_len, options.seed
    )
    print(f"offline engine, same requests all queued at once: {offline:.0f} output tok/s\n")
    header = (
        f"{'setting':<22}{'rate':>6}{'req/s':>7}{'out tok/s':>10}{'vs offline':>11}"
        f"{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}{'p99':>7}{'ITL p50':>8}{'p99':>7}"
    )
    print(header + "   (latencies in ms)")
    for name, flags in SETTINGS.items():
        with tandem_process(
            "serve", "--model", "stdlib-lm", *flags, "--log-level", "warning"
        ) as base_url:
            for rate in rates:
                bench_parser = argparse.ArgumentParser()
                add_arguments(bench_parser)
                args = bench_parser.parse_args(
                    [
                        "--base-url", base_url, "--tokenizer", str(DEFAULT_MODEL),
                        "--num-prompts", str(options.num_prompts),
                        "--random-input-len", str(options.input_len),
                        "--random-output-len", str(options.output_len),
                        "--ignore-eos", "--request-rate", str(rate),
                        "--seed", str(options.seed), "--no-progress",
                    ]
                )  # fmt: skip
                with contextlib.redirect_stdout(io.StringIO()):
                    s = run(args)
                rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
                print(
                    f"{name:<22}{rate_text:>6}{s['request_throughput']:>7.2f}"
                    f"{s['output_throughput']:>10.0f}{s['output_throughput'] / offline:>10.2f}x"
                    f"{s['median_ttft_ms']:>9.0f}{s['p99_ttft_ms']:>7.0f}"
                    f"{s['median_tpot_ms']:>9.1f}{s['p99_tpot_ms']:>7.1f}"
                    f"{s['median_itl_ms']:>8.1f}{s['p99_itl_ms']:>7.1f}"
                    + (f"  ({s['failed']} failed)" if s["failed"] else "")
                )


if __name__ == "__main__":
    main()
