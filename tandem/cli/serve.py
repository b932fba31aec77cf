"""``tandem serve``: the OpenAI-compatible HTTP server (tandem/server/)."""

from __future__ import annotations

import argparse
import dataclasses

from tandem.cli.engine_args import (
    add_engine_arguments,
    checked_threads,
    engine_options,
    model_or_default,
)
from tandem.server.limits import ServerLimits
from tandem.server.reasoning import CHOICES as REASONING_CHOICES
from tandem.server.tool_formats import CHOICES as TOOL_CALL_CHOICES

HELP = "an OpenAI-compatible HTTP server"
LIMIT_HELP = {
    "max_body_bytes": "larger request bodies get 413",
    "max_n": "largest n (samples per prompt)",
    "max_prompts": "most prompts in one completions request",
    "max_stop_strings": "most stop strings per request",
    "max_stop_string_chars": "longest stop string",
    "max_stop_token_ids": "most stop token ids per request",
    "max_logit_bias": "most logit_bias entries per request",
    "max_tool_calls": "most calls in an answer held to tool_choice required, parallel on",
    "header_timeout": "seconds a client has to send its request headers",
    "body_timeout": "seconds a client has to send its request body (then 408)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    http = parser.add_argument_group("HTTP")
    http.add_argument(
        "--host", default="127.0.0.1", metavar="ADDR",
        help="bind address (default: 127.0.0.1, loopback only)",
    )  # fmt: skip
    http.add_argument("--port", type=int, default=8000, metavar="PORT", help="(default: 8000)")
    http.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY')",
    )  # fmt: skip
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
    http.add_argument(
        "--enable-trace-endpoints", action="store_true",
        help="allow POST /trace/start and /trace/stop without --api-key (off by default)",
    )  # fmt: skip
    http.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_CHOICES, default="auto", metavar="PARSER",
        help="the format chat answers write tool calls in: hermes (<tool_call> JSON: "
        "Hermes, Qwen 2.5/3), qwen3_xml (<function=...>: Qwen3-Coder, Qwen3.5), "
        "llama3_json (Llama 3.x), mistral ([TOOL_CALLS]), deepseek_v3, pythonic "
        "([f(x=1)]), or vLLM's names for them; auto (the default): the one the chat "
        "template writes, else hermes",
    )  # fmt: skip
    http.add_argument(
        "--reasoning-parser", choices=REASONING_CHOICES, default="auto",
        help="how a thinking model's answers are split into reasoning_content and "
        "content: think (<think>...</think>: Qwen3, DeepSeek-R1, SmolLM3; also named "
        "deepseek_r1, qwen3), none, or auto: think when the chat template uses the tag",
    )  # fmt: skip
    http.add_argument(
        "--no-engine-process", action="store_true",
        help="run the engine core on a thread of the server's process (for debugging; "
        "by default it runs in its own process, beside the HTTP server's)",
    )  # fmt: skip
    http.add_argument(
        "--data-parallel-size", type=int, default=1, metavar="N",
        help="N engine cores behind this server, each a whole engine (its own process, "
        "KV cache and --tensor-parallel-size ranks) on its own share of the CPUs; "
        "requests go to the core with the fewest in flight (default: 1)",
    )  # fmt: skip
    http.add_argument(
        "--data-parallel-routing", choices=["least-busy", "prefix"], default="least-busy",
        help="with --data-parallel-size: least-busy, or prefix: a prompt goes to the core "
        "its first KV block maps to (whose prefix cache likely holds it) unless that core "
        "is busier than the least busy by more than 4 requests (default: least-busy)",
    )  # fmt: skip
    add_limit_arguments(parser, LIMIT_HELP)
    add_engine_arguments(parser, kv_transfer=True)


def add_limit_arguments(parser: argparse.ArgumentParser, names) -> None:
    """A flag for each ServerLimits field in ``names``."""
    limits = parser.add_argument_group("limits on what one client may ask")
    for field in dataclasses.fields(ServerLimits):
        if field.name in names:
            limits.add_argument(
                f"--{field.name.replace('_', '-')}", type=type(field.default),
                default=field.default, metavar="N",
                help=f"{LIMIT_HELP[field.name]} (default: {field.default})",
            )  # fmt: skip


def limits_from(args: argparse.Namespace) -> ServerLimits:
    """ServerLimits from the flags given (defaults for the fields without one)."""
    fields = dataclasses.fields(ServerLimits)
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields if hasattr(args, f.name)})


def run(args: argparse.Namespace) -> None:
    from tandem.models.hub import parse_hub_id
    from tandem.server.serve import run_server

    # A Hugging Face model is served under its id, as vLLM does.
    hub_id = parse_hub_id(args.model) if args.model else None
    run_server(
        model_or_default(args),
        engine_options(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name or (str(hub_id) if hub_id else None),
        max_waiting_requests=args.max_waiting_requests,
        log_level=args.log_level,
        trace=args.trace,
        limits=limits_from(args),
        enable_trace_endpoints=args.enable_trace_endpoints,
        engine_process=not args.no_engine_process,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        threads=checked_threads(args),
        data_parallel_size=args.data_parallel_size,
        data_parallel_routing=args.data_parallel_routing,
    )
