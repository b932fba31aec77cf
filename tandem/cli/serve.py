"""``tandem serve``: the OpenAI-compatible HTTP server (tandem/server/)."""

from __future__ import annotations

import argparse

from tandem.cli.engine_args import add_engine_arguments, apply_threads, engine_options

HELP = "an OpenAI-compatible HTTP server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    http = parser.add_argument_group("HTTP")
    http.add_argument(
        "--host", default="127.0.0.1", metavar="ADDR",
        help="bind address (default: 127.0.0.1, loopback only)",
    )  # fmt: skip
    http.add_argument("--port", type=int, default=8000, metavar="PORT", help="(default: 8000)")
    http.add_argument(
        "--api-key", default=None, metavar="KEY", help="require 'Authorization: Bearer KEY'"
    )
    http.add_argument(
        "--served-model-name", default=None, metavar="NAME",
        help="the model's name in the API (default: its folder's name)",
    )  # fmt: skip
    http.add_argument(
        "--max-waiting-requests", type=int, default=None, metavar="N",
        help="answer 503 when this many requests already wait (default: no limit)",
    )  # fmt: skip
    http.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning"],
        help="(default: info)",
    )  # fmt: skip
    http.add_argument(
        "--trace", metavar="FILE", help="trace every step; the file is written at shutdown"
    )
    add_engine_arguments(parser, kv_transfer=True)


def run(args: argparse.Namespace) -> None:
    from tandem.models.bundled import default_model
    from tandem.server.serve import run_server

    apply_threads(args)
    run_server(
        args.model or default_model(),
        engine_options(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        log_level=args.log_level,
        trace=args.trace,
    )
