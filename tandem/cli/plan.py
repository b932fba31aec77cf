"""``tandem plan``: will it fit, and how fast at best (tandem/plan/)."""

from __future__ import annotations

import argparse

HELP = "KV cache and roofline calculator: will it fit, how fast at best?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.plan.hardware import PRESETS

    parser.add_argument(
        "--model", required=True, metavar="PATH",
        help="a folder, a config.json or a GGUF file (priced in its own formats)",
    )  # fmt: skip
    parser.add_argument(
        "--hardware", default="h100-sxm",
        choices=[*PRESETS, "cpu", "custom"],
        help="a datasheet preset; cpu: this machine, measured; custom: give the three below",
    )  # fmt: skip
    parser.add_argument("--bandwidth", type=float, metavar="GB/S", help="(custom)")
    parser.add_argument("--flops", type=float, metavar="TFLOP/S", help="(custom)")
    parser.add_argument("--memory", type=float, metavar="GB", help="per device (custom)")
    parser.add_argument(
        "--dtype", default=None, metavar="DTYPE",
        help="weights: fp32 bf16 fp16 fp8 int8, or llama.cpp's q8_0 q4_0 q4_1 q4_k q6_k "
        "(their bytes per weight; computed at the bf16 rate on a GPU, the fp32 rate on "
        "this CPU), or gguf: a GGUF file's own formats, tensor by tensor, at the rate of "
        "tandem's integer-dot kernel (default: gguf for a GGUF file; else bf16, or fp32 "
        "for this machine, as the engine runs it)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-dtype", default=None, metavar="DTYPE",
        help="(default: what the engine's cache holds: --dtype for float weights; for "
        "block formats, fp8 and int8 the dtype it computes in: fp32 on this CPU, bf16 on a GPU)",
    )  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=1024, metavar="TOKENS")
    parser.add_argument("--output-len", type=int, default=256, metavar="TOKENS")
    parser.add_argument("--batch", type=int, default=1, metavar="N")
    parser.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel devices")
    add_tp_link_arguments(parser)
    parser.add_argument(
        "--measure", action="store_true", help="measure this machine and run tandem on it"
    )
    parser.add_argument(
        "--calibrate", metavar="FILE",
        help="with --measure: time a sweep of real engine steps, fit the step cost model "
        "(tandem/plan/cost.py) and save it as JSON; with --from-trace: fit it to a serving "
        "run's steps instead",
    )  # fmt: skip
    parser.add_argument(
        "--from-trace", metavar="TRACE",
        help="a step trace of `tandem serve` under load (POST /trace/start, /trace/stop): "
        "fit on its steps, contention with the server and its clients included",
    )  # fmt: skip
    parser.add_argument(
        "--client-ttft-ms", type=float, default=None, metavar="MS",
        help="with --from-trace: the clients' mean TTFT in that run (bench serve's), to "
        "fit a request's time outside the engine",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_tp_link_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tp-link-gbs", type=float, default=None, metavar="GB/S",
        help="with --tp: GB/s each way between two ranks (default: the hardware's: NVLink "
        "or PCIe from its datasheet; this machine's memory bandwidth)",
    )  # fmt: skip
    parser.add_argument(
        "--tp-link-latency-us", type=float, default=None, metavar="US",
        help="with --tp: one small all-reduce's latency (default: the hardware's; 20 us "
        "between GPUs, the shared-memory figure of benchmarks/tensor_parallel.py here)",
    )  # fmt: skip


def tp_link(args: argparse.Namespace, hardware) -> tuple[float, float]:
    """(GB/s, seconds): the flags over the hardware's figures."""
    from tandem.errors import InvalidParameterError

    link_gbs, latency_s = hardware.link()
    if args.tp_link_gbs is not None:
        if args.tp_link_gbs <= 0:
            raise InvalidParameterError("--tp-link-gbs", "must be > 0")
        link_gbs = args.tp_link_gbs
    if args.tp_link_latency_us is not None:
        if args.tp_link_latency_us < 0:
            raise InvalidParameterError("--tp-link-latency-us", "must be >= 0")
        latency_s = args.tp_link_latency_us * 1e-6
    return link_gbs, latency_s


def run(args: argparse.Namespace) -> None:
    import json

    from tandem.errors import InvalidParameterError
    from tandem.models.catalog import resolve_model
    from tandem.models.gguf_checkpoint import find_gguf
    from tandem.plan.calculator import (
        FILE_DTYPE,
        engine_kv_dtype,
        format_plan,
        plan,
        plan_arguments,
        read_model,
    )
    from tandem.plan.hardware import PRESETS, custom_hardware
    from tandem.plan.measure import check_measurable, measure_model, this_machine

    if (args.from_trace or args.client_ttft_ms is not None) and not args.calibrate:
        raise InvalidParameterError("--from-trace", "and --client-ttft-ms need --calibrate FILE")
    if args.client_ttft_ms is not None and not args.from_trace:
        raise InvalidParameterError("--client-ttft-ms", "is the clients' TTFT of --from-trace")
    on_this_machine = args.measure or args.hardware == "cpu"
    gguf = find_gguf(resolve_model(args.model))
    if args.dtype is None:  # what the engine runs: a GGUF's formats; else float32 on a
        # CPU, bf16 on a GPU
        args.dtype = FILE_DTYPE if gguf is not None else "fp32" if on_this_machine else "bf16"
    if args.kv_dtype is None:
        args.kv_dtype = engine_kv_dtype(args.dtype, on_cpu=on_this_machine)
    # Checked (and named as the plan names them) before seconds of measuring.
    dtype, kv_dtype, _ = plan_arguments(
        args.model, args.dtype, args.kv_dtype, args.prompt_len, args.output_len, args.batch,
        args.tp, on_this_machine,
    )  # fmt: skip
    if args.measure:
        check_measurable(args.model, dtype)
    if on_this_machine:
        config, _ = read_model(args.model)
        hardware = this_machine(
            dtype, gguf if dtype == FILE_DTYPE else None, config, args.prompt_len, kv_dtype,
            args.batch,
        )  # fmt: skip
    elif args.hardware == "custom":
        hardware = custom_hardware(args.memory, args.bandwidth, args.flops)
    else:
        hardware = PRESETS[args.hardware]
    result = plan(
        args.model, hardware, args.dtype, args.kv_dtype, args.prompt_len, args.output_len,
        args.batch, args.tp, engine_cpu=on_this_machine, link=tp_link(args, hardware),
    )  # fmt: skip
    if args.measure:
        result["measured"] = measure_model(args.model, result)
    if args.calibrate:
        result["calibrated"] = calibrate_cost_model(args, result)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))


def calibrate_cost_model(args: argparse.Namespace, result: dict) -> dict:
    """Fit the step cost model on this machine; save it to ``args.calibrate``."""
    import json
    import statistics
    from pathlib import Path

    from tandem.errors import InvalidParameterError
    from tandem.plan.calculator import experts_block, read_model
    from tandem.plan.calibrate import calibrate, fit_trace
    from tandem.plan.cost import ModelShape
    from tandem.plan.measure import engine_dtype

    if not args.measure and not args.from_trace:
        raise InvalidParameterError(
            "--calibrate", "needs --measure (it runs on this machine) or --from-trace"
        )
    dtype = engine_dtype(result["dtype"])
    config, params = read_model(args.model)
    element = 2 if dtype == "bfloat16" else 4
    block = experts_block(args.model) if config.moe else 1
    shape = ModelShape.of(config, params, element, element, block)
    if args.from_trace:
        try:
            trace = json.loads(Path(args.from_trace).read_text())
        except (OSError, ValueError) as error:
            raise InvalidParameterError("--from-trace", f"cannot read it: {error}") from None
        client_ttft = args.client_ttft_ms / 1e3 if args.client_ttft_ms is not None else None
        try:
            model, samples = fit_trace(shape, trace, client_ttft)
        except ValueError as error:
            raise InvalidParameterError("--from-trace", str(error)) from None
    else:
        model, samples = calibrate(args.model, shape, dtype, config.max_position_embeddings)
    model.save(args.calibrate)
    errors = [abs(model.step_seconds(shape, s) - t) / t for s, t in samples]
    return {
        "file": args.calibrate,
        "bandwidth_gbs": model.bandwidth_gbs,
        "tflops": model.tflops,
        "step_overhead_s": model.step_overhead_s,
        "request_overhead_s": model.request_overhead_s,
        "token_overhead_s": model.token_overhead_s,
        "frontend_s": model.frontend_s,
        "steps": len(samples),
        "median_error": statistics.median(errors),
        "max_error": max(errors),
    }
