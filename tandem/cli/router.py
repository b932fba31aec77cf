"""``tandem router``: one OpenAI-compatible front for prefill and decode instances."""

from __future__ import annotations

import argparse

from tandem.cli.serve import add_limit_arguments, limits_from

HELP = "an OpenAI-compatible front for prefill and decode instances"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL")
    parser.add_argument("--host", default="127.0.0.1", metavar="ADDR", help="(default: loopback)")
    parser.add_argument("--port", type=int, default=8000, metavar="PORT", help="(default: 8000)")
    parser.add_argument(
        "--local-prefill-threshold", type=int, default=0, metavar="TOKENS",
        help="prompts shorter than this go straight to a decode instance (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="per call (default: 600)"
    )
    parser.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' (forwarded to the instances: give them the "
        "same --api-key)",
    )  # fmt: skip
    # The instances check what requests ask; the router bounds what clients send it.
    add_limit_arguments(parser, ("max_body_bytes", "header_timeout", "body_timeout"))


def run(args: argparse.Namespace) -> None:
    from tandem.server.pd_router import run_router

    run_router(
        args.prefill, args.decode, args.host, args.port, args.local_prefill_threshold,
        args.timeout, args.api_key, limits_from(args),
    )  # fmt: skip
