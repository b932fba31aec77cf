"""``tandem simulate``: the real scheduler on a cost model (tandem/plan/simulate.py)."""

from __future__ import annotations

import argparse

HELP = "predict TTFT/TPOT/goodput for a workload: the real scheduler on a step cost model"

# Scheduler and cache flags, as `tandem serve` takes them.
ENGINE_FLAGS = {
    "max_num_batched_tokens": (int, "token budget per step"),
    "max_num_seqs": (int, "requests running at once"),
    "scheduling_policy": (str, "chunked or prefill-first"),
    "long_prefill_token_threshold": (int, "cap on one prompt's chunk per step"),
    "block_size": (int, "tokens per KV block (default: 16)"),
    "num_blocks": (int, "KV blocks (default: what fits beside the weights)"),
    "max_model_len": (int, "context length (default: the model's)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.bench.serve import add_workload_arguments
    from tandem.plan.hardware import PRESETS

    parser.add_argument("--model", required=True, metavar="PATH", help="a folder or a config.json")
    costs = parser.add_mutually_exclusive_group(required=True)
    costs.add_argument(
        "--cost", metavar="FILE",
        help="a step cost model fitted on a machine (tandem plan --measure --calibrate FILE)",
    )  # fmt: skip
    costs.add_argument(
        "--hardware", choices=sorted(PRESETS),
        help="a datasheet roofline (a floor: no overheads, so optimistic)",
    )  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, metavar="N", help="(with --hardware)")
    parser.add_argument(
        "--dtype", default=None, choices=["fp32", "bf16"],
        help="weights and KV (default: fp32 with --cost, as the CPU engine runs; bf16 with "
        "--hardware)",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="for text prompts (jsonl): their lengths in this tokenizer (default: one token "
        "per 4 bytes)",
    )  # fmt: skip
    engine = parser.add_argument_group("scheduler and cache")
    for name, (kind, text) in ENGINE_FLAGS.items():
        engine.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=text)
    engine.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None
    )
    add_workload_arguments(parser)
    parser.add_argument("--trace", metavar="FILE", help="the simulated steps as a Chrome trace")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> None:
    import json
    import math
    import os
    import time

    from tandem.bench.datasets import LocalTokenizer
    from tandem.bench.serve import arrival_gaps, workload_requests
    from tandem.bench.summary import format_table, parse_goodput, summarize
    from tandem.config import EngineConfig
    from tandem.errors import InvalidParameterError
    from tandem.plan.calculator import MEMORY_UTILIZATION, read_model
    from tandem.plan.cost import ModelShape, StepCostModel
    from tandem.plan.hardware import PRESETS
    from tandem.plan.simulate import simulate

    if args.request_rate <= 0 or args.burstiness <= 0:
        raise InvalidParameterError("--request-rate", "and --burstiness must be > 0")
    slos = parse_goodput(args.goodput)
    config_model, params = read_model(args.model)
    dtype = args.dtype or ("fp32" if args.cost else "bf16")
    element = 4 if dtype == "fp32" else 2
    shape = ModelShape.of(config_model, params, element, element)
    if args.cost:
        cost = StepCostModel.load(args.cost)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        hardware = PRESETS[args.hardware]
        cost = StepCostModel.from_hardware(hardware, dtype, args.tp)
        memory = hardware.memory_gb * 1e9 * args.tp
    options = {name: value for name in ENGINE_FLAGS if (value := getattr(args, name)) is not None}
    if args.enable_prefix_caching is not None:
        options["enable_prefix_caching"] = args.enable_prefix_caching
    config = EngineConfig.from_kwargs(args.model, **options)
    max_model_len = config.max_model_len or config_model.max_position_embeddings
    num_blocks = config.cache.num_blocks
    if num_blocks is None:  # what fits beside the weights, as `tandem plan` counts it
        room = MEMORY_UTILIZATION * memory - shape.weight_bytes
        num_blocks = int(room / shape.kv_bytes_per_token) // config.cache.block_size
        if num_blocks < 1:
            raise InvalidParameterError("--num-blocks", "the weights leave no room for KV")
    tokenizer = LocalTokenizer(args.tokenizer) if args.tokenizer else _BytesTokenizer(
        config_model.vocab_size
    )  # fmt: skip
    requests = workload_requests(args, tokenizer)
    for request in requests:  # text prompts (jsonl): token ids of their length
        if request.prompt_token_ids is None:
            request.prompt_token_ids = tokenizer.encode(request.prompt_text)
    gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)
    started = time.perf_counter()
    result = simulate(
        requests, gaps, shape, cost, config, num_blocks, max_model_len,
        config_model.vocab_size, args.trace,
    )  # fmt: skip
    wall = time.perf_counter() - started
    summary = summarize(result.results, result.duration, slos)
    summary["prefix_cache_hit_rate"] = result.prefix_cache_hit_rate
    summary.update(
        simulated_steps=result.num_steps, busy_fraction=result.busy_s / result.duration,
        preemptions=result.num_preemptions, num_blocks=num_blocks, cost_model=cost.source,
        wall_seconds=wall,
    )  # fmt: skip
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))
        return
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    print(
        f"simulated: {len(requests)} requests at {rate} req/s on {cost.source}; "
        f"{result.num_steps:,} steps, {num_blocks:,} KV blocks, "
        f"{result.num_preemptions} preemptions, in {wall:.2f} s of wall time"
    )
    print(format_table(summary, slos))


class _BytesTokenizer:
    """Token ids for text without a tokenizer: one per 4 bytes (about English's rate)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        return [
            1 + int.from_bytes(data[i : i + 4], "little") % (self.vocab_size - 1)
            for i in range(0, len(data), 4)
        ]

    def decode(self, ids: list[int]) -> str:
        return ""
