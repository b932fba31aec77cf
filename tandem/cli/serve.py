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
    disagg = parser.add_argument_group("disaggregated serving")
    disagg.add_argument(
        "--role", choices=["both", "prefill", "decode"], default="both",
        help="run prompts only (prefill) or decode with pulled KV (decode); default: both",
    )  # fmt: skip
    disagg.add_argument(
        "--kv-port", type=int, default=0, metavar="PORT", help="KV transfer port (0: any free)"
    )
    disagg.add_argument(
        "--kv-lease-seconds", type=float, default=30.0, metavar="S",
        help="prefill: how long finished prompts keep their blocks for a decode side "
        "(default: 30)",
    )  # fmt: skip
    disagg.add_argument(
        "--kv-backend", choices=["auto", "zmq", "nixl"], default="auto",
        help="KV transfer: NIXL when the nixl package is installed (auto), else ZeroMQ",
    )  # fmt: skip
    disagg.add_argument(
        "--kv-transfer-failure", choices=["recompute", "fail"], default="recompute",
        help="decode: when the KV pull fails, recompute the prompt here or fail the request",
    )  # fmt: skip
    add_engine_arguments(parser)


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
        role=args.role,
        kv_port=args.kv_port,
        kv_lease_seconds=args.kv_lease_seconds,
        kv_transfer_failure=args.kv_transfer_failure,
        kv_backend=args.kv_backend,
    )
