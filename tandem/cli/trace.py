"""``tandem trace plot``: a Chrome trace from --trace -> a swimlane PNG."""

from __future__ import annotations

import argparse

HELP = "a Chrome trace (from --trace) -> a swimlane PNG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace_file", metavar="TRACE_JSON")
    parser.add_argument(
        "-o", "--output", default="timeline.png", metavar="PNG", help="(default: timeline.png)"
    )
    parser.add_argument("--title", default=None, help="the picture's title")


def run(args: argparse.Namespace) -> None:
    from tandem.trace.plot import plot_trace

    print(plot_trace(args.trace_file, args.output, args.title))
