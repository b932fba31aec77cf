"""``tandem bench serve``: load an OpenAI-compatible server and measure it.

Requests arrive at ``--request-rate`` per second with gamma-distributed gaps
(``--burstiness`` 1 is a Poisson process, lower is burstier, ``inf`` rate sends all at
once), optionally capped at ``--max-concurrency`` in flight. Each is streamed and timed
(client.py); the summary follows vLLM's definitions (summary.py). The client speaks
only the public API (plus ``/tokenize`` when no local tokenizer is given), so it
measures any OpenAI-compatible server, not just tandem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

from tandem.bench.client import RequestResult, RequestSettings, send_request
from tandem.bench.datasets import (
    BenchRequest,
    LocalTokenizer,
    ServerTokenizer,
    jsonl_requests,
    prefix_repetition_requests,
    random_requests,
)
from tandem.bench.summary import format_table, parse_goodput, summarize
from tandem.errors import TandemError
from tandem.step import SpecDecodeStats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--tokenizer", default=None, help="local model folder (default: /tokenize)")
    add_workload_arguments(parser)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate the full length")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--save-result", default=None, metavar="FILE.json")
    parser.add_argument("--no-progress", action="store_true")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What is sent and when, and the SLOs it is judged by (`tandem simulate` too)."""
    parser.add_argument(
        "--dataset", choices=["random", "prefix-repetition", "jsonl"], default="random"
    )
    parser.add_argument("--dataset-path", default=None, help="the jsonl file")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=512)
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=64)
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: all now")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument(
        "--goodput", nargs="+", default=None, metavar="NAME:MS", help="e.g. ttft:500 tpot:50"
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise TandemError("--request-rate and --burstiness must be > 0")
    slos = parse_goodput(args.goodput)
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _first_model(base_url, headers)
    tokenizer = (
        LocalTokenizer(args.tokenizer)
        if args.tokenizer
        else ServerTokenizer(base_url, model, headers)
    )
    requests = workload_requests(args, tokenizer)
    # Chat needs text; token-id prompts are decoded once, before the clock starts.
    texts = [
        r.prompt_text
        if r.prompt_text is not None or args.endpoint == "completions"
        else tokenizer.decode(r.prompt_token_ids)
        for r in requests
    ]
    settings = RequestSettings(
        base_url, model, args.endpoint, headers, args.temperature, args.ignore_eos, args.timeout
    )
    spec_before = spec_decode_counters(base_url, headers)
    results, duration = asyncio.run(
        _benchmark(requests, texts, settings, args, progress=not args.no_progress)
    )
    summary = summarize(results, duration, slos)
    summary.update(spec_decode_summary(spec_before, spec_decode_counters(base_url, headers)))
    print(format_table(summary, slos))
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; the first error: {errors[0]}")
    if args.save_result:
        _save(args, model, summary, results)
    return summary


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_counters(base_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The server's speculative-decoding counters from /metrics (tandem's or vLLM's
    names), or None when it exports none."""
    try:
        response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        prefix, _, name = family.name.partition(":spec_decode_")
        if prefix in ("tandem", "vllm") and name in SPEC_COUNTERS:
            found[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return found if len(found) == len(SPEC_COUNTERS) else None


def spec_decode_summary(before, after) -> dict[str, float]:
    """Acceptance over the run: accepted / proposed draft tokens, and tokens per
    verification (accepted + the one the target adds)."""
    if before is None or after is None:
        return {}
    run = SpecDecodeStats(**after).minus(SpecDecodeStats(**before))
    if run.num_drafts <= 0:
        return {}
    return {
        "spec_decode_acceptance_rate": run.acceptance_rate,
        "spec_decode_mean_acceptance_length": run.mean_acceptance_length,
    }


def _first_model(base_url: str, headers: dict[str, str]) -> str:
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise TandemError(f"cannot reach {base_url}: {exc}") from exc
    if response.status_code != 200:
        raise TandemError(f"GET {base_url}/v1/models: HTTP {response.status_code}")
    return response.json()["data"][0]["id"]


def workload_requests(args: argparse.Namespace, tokenizer) -> list[BenchRequest]:
    if args.dataset == "random":
        return random_requests(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.seed,
        )  # fmt: skip
    if args.dataset == "prefix-repetition":
        return prefix_repetition_requests(
            tokenizer, args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, args.seed,
        )  # fmt: skip
    if not args.dataset_path:
        raise TandemError("--dataset jsonl needs --dataset-path FILE")
    return jsonl_requests(args.dataset_path, args.num_prompts, args.random_output_len)


async def _benchmark(
    requests: list[BenchRequest],
    texts: list[str | None],
    settings: RequestSettings,
    args: argparse.Namespace,
    progress: bool,
) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=settings.base_url, headers=settings.headers, limits=limits, timeout=None
    ) as http:
        # One request alone first, as a check that the server answers at all.
        probe = await send_request(http, requests[0], settings, texts[0], time.perf_counter())
        if not probe.success:
            raise TandemError(f"the first test request failed: {probe.error}")

        gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)

        async def one(index: int, start: float) -> RequestResult:
            if gate is None:
                result = await send_request(http, requests[index], settings, texts[index], start)
            else:
                async with gate:
                    result = await send_request(
                        http, requests[index], settings, texts[index], start
                    )
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for index in range(len(requests)):
            tasks.append(asyncio.create_task(one(index, start)))
            if gaps[index]:
                await asyncio.sleep(gaps[index])
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
    return results, duration


def arrival_gaps(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait after sending each request (gamma-distributed with shape
    ``burstiness``, mean 1 / ``rate``; all zero for an infinite rate). The same seed
    gives the same schedule, so an offline replay can reproduce a run's arrivals."""
    if not math.isfinite(rate):
        return [0.0] * count
    rng = random.Random(seed)
    gaps = [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count - 1)]
    return [*gaps, 0.0]


def _save(args: argparse.Namespace, model: str, summary: dict, results: list[RequestResult]):
    record = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
        "model": model,
        **summary,
        "success": [r.success for r in results],
        "errors": [r.error for r in results],
        "start_times": [r.start_time for r in results],
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [r.tpot for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.e2el for r in results],
    }
    if not math.isfinite(args.request_rate):
        record["config"]["request_rate"] = "inf"
    Path(args.save_result).write_text(json.dumps(record, indent=1))
