"""Benchmark metrics from per-request results, defined as vLLM defines them.

    TTFT   sending -> first generated text           (per request)
    TPOT   (E2EL - TTFT) / (output tokens - 1)       (per request with >= 2 tokens)
    ITL    every gap between consecutive chunks      (pooled over requests)
    E2EL   sending -> [DONE]                         (per request)
    goodput  requests/s that met every given SLO (ttft, tpot, e2el in ms)

Failed requests count as failed and are left out of the latency figures.
"""

from __future__ import annotations

import statistics
from typing import Any

from tandem.bench.client import RequestResult
from tandem.errors import TandemError

PERCENTILES = (50, 90, 99)
SLO_NAMES = ("ttft", "tpot", "e2el")


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> SLOs in milliseconds."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_NAMES or not value:
            raise TandemError(f"--goodput takes NAME:MS with NAME in {SLO_NAMES}, got {item!r}")
        slos[name] = float(value)
    return slos


def _meets(result: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return all(values[name] * 1e3 <= limit for name, limit in slos.items())


def summarize(
    results: list[RequestResult], duration: float, slos: dict[str, float]
) -> dict[str, Any]:
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    # Share of prompt tokens the server reports as served from its prefix cache.
    summary["prefix_cache_hit_rate"] = (
        sum(r.cached_tokens for r in done) / input_tokens if input_tokens else 0.0
    )
    if slos:
        summary["request_goodput"] = sum(_meets(r, slos) for r in done) / duration
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2el for r in done],
    }
    for name, values in series.items():
        values_ms = [v * 1e3 for v in values]
        summary[f"mean_{name}_ms"] = statistics.fmean(values_ms) if values_ms else 0.0
        summary[f"std_{name}_ms"] = statistics.pstdev(values_ms) if values_ms else 0.0
        for p in PERCENTILES:
            label = "median" if p == 50 else f"p{p}"
            summary[f"{label}_{name}_ms"] = percentile(values_ms, p)
    return summary


def format_table(summary: dict[str, Any], slos: dict[str, float]) -> str:
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        row("Request goodput (req/s):", summary["request_goodput"])
        lines.append("  SLOs: " + ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in slos.items()))
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    row("Prefix cache hit rate (%):", 100 * summary["prefix_cache_hit_rate"])
    if "spec_decode_acceptance_rate" in summary:
        row("Draft acceptance rate (%):", 100 * summary["spec_decode_acceptance_rate"])
        row("Mean acceptance length:", summary["spec_decode_mean_acceptance_length"])
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for name, title in titles.items():
        lines.append(f" {title} ".center(width, "-"))
        row(f"Mean {name.upper()} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", summary[f"median_{name}_ms"])
        for p in PERCENTILES[1:]:
            row(f"P{p} {name.upper()} (ms):", summary[f"p{p}_{name}_ms"])
    lines.append("=" * width)
    return "\n".join(lines)
