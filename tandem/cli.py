"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import sys

from tandem.errors import TandemError

ENGINE_FLAGS = {
    # flag: (engine option, type, help)
    "--dtype": ("dtype", str, "auto | float32 | bfloat16 | float16"),
    "--device": ("device", str, "cpu | cuda"),
    "--block-size": ("block_size", int, "tokens per KV cache block"),
    "--num-blocks": ("num_blocks", int, "KV cache blocks (default: from the memory budget)"),
    "--kv-cache-memory": ("kv_cache_memory", int, "KV cache budget in bytes"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "token budget per step"),
    "--max-num-seqs": ("max_num_seqs", int, "requests running at once"),
    "--long-prefill-token-threshold": ("long_prefill_token_threshold", int, "chunk cap"),
    "--scheduling-policy": ("scheduling_policy", str, "chunked | prefill-first"),
    "--max-model-len": ("max_model_len", int, "context length (default: the model's)"),
    "--seed": ("seed", int, "engine seed"),
    "--enable-prefix-caching": (
        "enable_prefix_caching",
        bool,
        "reuse the KV of prompt starts seen before (default: on)",
    ),
}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="local Hugging Face model folder (default: the bundled one)"
    )
    for flag, (dest, kind, text) in ENGINE_FLAGS.items():
        if kind is bool:  # --flag / --no-flag
            parser.add_argument(
                flag, dest=f"engine_{dest}", action=argparse.BooleanOptionalAction, help=text
            )
        else:
            parser.add_argument(flag, dest=f"engine_{dest}", type=kind, default=None, help=text)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    parser.add_argument(
        "--speculative-method", choices=["ngram", "draft"], default=None,
        help="speculative decoding: n-gram prompt lookup or a draft model",
    )  # fmt: skip
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="k (default 4)")
    parser.add_argument(
        "--draft-model", default=None, help="the draft's folder (default: the bundled draft)"
    )
    parser.add_argument(
        "--speculative-disable-by-batch-size", type=int, default=None,
        help="no speculation while this many requests run (default 64)",
    )  # fmt: skip


def backslash_escapes(value: str) -> str:
    """``\\n``, ``\\t``, ``\\uXXXX`` ... as the characters they name (a shell passes
    ``"\\n"`` as two characters); other text, non-ASCII included, is kept as it is."""
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def engine_options(args: argparse.Namespace) -> dict:
    options = {}
    for dest, _, _ in ENGINE_FLAGS.values():
        value = getattr(args, f"engine_{dest}")
        if value is not None:
            options[dest] = value
    if args.speculative_method is not None:
        speculative = {"method": args.speculative_method, "model": args.draft_model}
        if args.num_speculative_tokens is not None:
            speculative["num_speculative_tokens"] = args.num_speculative_tokens
        if args.speculative_disable_by_batch_size is not None:
            speculative["disable_by_batch_size"] = args.speculative_disable_by_batch_size
        options["speculative_config"] = speculative
    return options


def _generate(args: argparse.Namespace) -> None:
    import torch

    from tandem import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, **engine_options(args))
    chosen = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "repetition_penalty": args.repetition_penalty,
    }
    params = llm.get_default_sampling_params(
        **{name: value for name, value in chosen.items() if value is not None},
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.chat:
        prompt = {
            "prompt_token_ids": llm.get_tokenizer().encode_chat(
                [{"role": "user", "content": args.prompt}]
            )
        }
    else:
        prompt = args.prompt
    if args.trace:
        llm.start_trace()
    num_tokens = 0
    for output in llm.stream(prompt, params, request_id="cli"):
        completion = output.outputs[0]
        sys.stdout.write(completion.text)
        sys.stdout.flush()
        num_tokens += len(completion.token_ids)
        final = output
    sys.stdout.write("\n")
    if args.trace:
        llm.stop_trace(args.trace)
    completion = final.outputs[0]
    m = completion.metrics
    elapsed = m.token_times[-1] - m.arrival_time
    tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot is not None else "n/a"
    print(
        f"[{len(final.prompt_token_ids)} prompt tokens, {num_tokens} generated, "
        f"finish: {completion.finish_reason}] TTFT {m.ttft * 1e3:.1f} ms, TPOT {tpot}, "
        f"{num_tokens / elapsed:.1f} tokens/s",
        file=sys.stderr,
    )


def _serve(args: argparse.Namespace) -> None:
    import torch

    from tandem.models.bundled import default_model
    from tandem.server.serve import run_server

    if args.threads:
        torch.set_num_threads(args.threads)
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


def _bench_serve(args: argparse.Namespace) -> None:
    from tandem.bench.serve import run

    run(args)


def _trace_plot(args: argparse.Namespace) -> None:
    from tandem.trace.plot import plot_trace

    print(plot_trace(args.trace_file, args.output, args.title))


def _plan(args: argparse.Namespace) -> None:
    import json

    from tandem.plan.calculator import format_plan, plan
    from tandem.plan.hardware import PRESETS, custom_hardware
    from tandem.plan.measure import measure_model, this_machine

    if args.measure or args.hardware == "cpu":
        hardware = this_machine(args.dtype)
    elif args.hardware == "custom":
        hardware = custom_hardware(args.memory, args.bandwidth, args.flops)
    else:
        hardware = PRESETS[args.hardware]
    result = plan(
        args.model, hardware, args.dtype, args.kv_dtype, args.prompt_len, args.output_len,
        args.batch, args.tp,
    )  # fmt: skip
    if args.measure:
        result["measured"] = measure_model(args.model, result)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))


def _router(args: argparse.Namespace) -> None:
    from tandem.disagg.router import run_router

    run_router(
        args.prefill, args.decode, args.host, args.port, args.local_prefill_threshold,
        args.timeout,
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="stream a completion for one prompt")
    add_engine_options(generate)
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64)
    # Sampling flags left unset take the model's generation_config.json values.
    model_default = "default: the model's generation_config.json"
    generate.add_argument("--temperature", type=float, help=f"0 = greedy ({model_default})")
    generate.add_argument("--top-p", type=float, help=model_default)
    generate.add_argument("--top-k", type=int, help=model_default)
    generate.add_argument("--repetition-penalty", type=float, help=model_default)
    generate.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    generate.add_argument(
        "--stop",
        action="append",
        default=None,
        type=backslash_escapes,
        metavar="TEXT",
        help="stop string; backslash escapes are read, so '\\n\\n' is two newlines (repeat)",
    )
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the chat template"
    )
    generate.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the steps")
    generate.set_defaults(func=_generate)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_engine_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--served-model-name", default=None, help="the model's API name (default: folder name)"
    )
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 when this many requests already wait (default: no limit)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    serve.add_argument(
        "--trace", metavar="FILE", help="trace every step; the file is written at shutdown"
    )
    serve.add_argument(
        "--role", choices=["both", "prefill", "decode"], default="both",
        help="disaggregated serving: run prompts only, or decode with pulled KV",
    )  # fmt: skip
    serve.add_argument("--kv-port", type=int, default=0, help="KV transfer port (0: any free)")
    serve.add_argument(
        "--kv-lease-seconds", type=float, default=30.0,
        help="prefill: how long finished prompts keep their blocks for a decode side",
    )  # fmt: skip
    serve.add_argument(
        "--kv-backend", choices=["auto", "zmq", "nixl"], default="auto",
        help="KV transfer: NIXL when the nixl package is installed (auto), else ZeroMQ",
    )  # fmt: skip
    serve.add_argument(
        "--kv-transfer-failure", choices=["recompute", "fail"], default="recompute",
        help="decode: when the KV pull fails, recompute the prompt here or fail the request",
    )  # fmt: skip
    serve.set_defaults(func=_serve)

    from tandem.bench.serve import add_arguments as add_bench_serve_arguments

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True
    )
    bench_serve = bench.add_parser(
        "serve", help="load an OpenAI-compatible server; TTFT, TPOT, ITL, goodput"
    )
    add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(func=_bench_serve)

    router = commands.add_parser(
        "router", help="an OpenAI-compatible front for prefill and decode instances"
    )
    router.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    router.add_argument("--decode", nargs="+", required=True, metavar="URL")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument(
        "--local-prefill-threshold", type=int, default=0,
        help="prompts shorter than this many tokens go straight to a decode instance",
    )  # fmt: skip
    router.add_argument("--timeout", type=float, default=600.0, help="per call, seconds")
    router.set_defaults(func=_router)

    planner = commands.add_parser(
        "plan", help="KV cache and roofline calculator: will it fit, how fast at best?"
    )
    planner.add_argument("--model", required=True, help="a model folder or a config.json")
    planner.add_argument(
        "--hardware", default="h100-sxm",
        choices=["a100-80g", "h100-sxm", "h200", "l4", "t4", "cpu", "custom"],
        help="a datasheet preset; cpu: this machine, measured; custom: give the three below",
    )  # fmt: skip
    planner.add_argument("--bandwidth", type=float, help="GB/s (custom)")
    planner.add_argument("--flops", type=float, help="TFLOP/s (custom)")
    planner.add_argument("--memory", type=float, help="GB per device (custom)")
    planner.add_argument("--dtype", default="bf16", help="weights: fp32 bf16 fp16 fp8 int8")
    planner.add_argument("--kv-dtype", default=None, help="KV cache (default: --dtype)")
    planner.add_argument("--prompt-len", type=int, default=1024)
    planner.add_argument("--output-len", type=int, default=256)
    planner.add_argument("--batch", type=int, default=1)
    planner.add_argument("--tp", type=int, default=1, help="tensor-parallel devices")
    planner.add_argument(
        "--measure", action="store_true", help="measure this machine and run tandem on it"
    )
    planner.add_argument("--json", action="store_true")
    planner.set_defaults(func=_plan)

    trace = commands.add_parser("trace", help="step traces").add_subparsers(
        dest="trace_command", required=True
    )
    plot = trace.add_parser("plot", help="a Chrome trace from --trace -> a swimlane PNG")
    plot.add_argument("trace_file")
    plot.add_argument("-o", "--output", default="timeline.png")
    plot.add_argument("--title", default=None)
    plot.set_defaults(func=_trace_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except TandemError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
