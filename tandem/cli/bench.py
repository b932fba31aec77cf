"""``tandem bench serve``: load any OpenAI-compatible server (tandem/bench/)."""

from __future__ import annotations

import argparse

HELP = "load an OpenAI-compatible server; TTFT, TPOT, ITL, goodput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.bench.serve import add_arguments as add_bench_arguments

    add_bench_arguments(parser)


def run(args: argparse.Namespace) -> None:
    from tandem.bench.serve import run as run_bench

    run_bench(args)
