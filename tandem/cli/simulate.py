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
    from tandem.cli.plan import add_tp_link_arguments
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
    add_tp_link_arguments(parser)
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
    cluster = parser.add_argument_group(
        "instances (routed as `tandem router` routes: fewest requests in flight)"
    )
    cluster.add_argument(
        "--instances", "--dp", type=int, default=1, metavar="N",
        help="colocated instances: data-parallel engine cores or servers (default: 1)",
    )  # fmt: skip
    cluster.add_argument(
        "--prefill", type=int, default=0, metavar="P",
        help="disaggregated: prefill instances (with --decode)",
    )  # fmt: skip
    cluster.add_argument("--decode", type=int, default=0, metavar="D", help="decode instances")
    cluster.add_argument(
        "--link-gbs", type=float, default=25.0, metavar="GB/S",
        help="each decode instance's link for pulling K/V (default: 25, a 200 Gb/s NIC)",
    )  # fmt: skip
    cluster.add_argument(
        "--link-latency-ms", type=float, default=0.1, metavar="MS", help="per transfer"
    )  # fmt: skip
    cluster.add_argument(
        "--local-prefill-threshold", type=int, default=0, metavar="TOKENS",
        help="shorter prompts skip the prefill instances (as the router's flag)",
    )  # fmt: skip
    cluster.add_argument(
        "--search", action="store_true",
        help="find the fewest instances, colocated or split P:D, that meet every --slo",
    )  # fmt: skip
    cluster.add_argument(
        "--slo", nargs="+", metavar="STAT_METRIC:MS",
        help="limits for --search, e.g. p90_ttft:500 p99_tpot:50 (STAT: mean, median, p90, "
        "p99; METRIC: ttft, tpot, itl, e2el)",
    )  # fmt: skip
    cluster.add_argument(
        "--max-instances", type=int, default=8, metavar="N", help="for --search (default: 8)"
    )  # fmt: skip
    add_workload_arguments(parser)
    parser.add_argument(
        "--trace", metavar="FILE",
        help="the simulated steps as a Chrome trace (one FILE.<instance>.json per instance "
        "when there are several)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> None:
    import json
    import os
    import time

    from tandem.bench.datasets import LocalTokenizer
    from tandem.bench.serve import arrival_gaps, workload_requests
    from tandem.bench.summary import format_table, parse_goodput, summarize
    from tandem.cli.plan import tp_link
    from tandem.config import EngineConfig
    from tandem.errors import InvalidParameterError
    from tandem.plan.calculator import MEMORY_UTILIZATION, experts_block, read_model
    from tandem.plan.cost import ModelShape, StepCostModel
    from tandem.plan.hardware import PRESETS
    from tandem.plan.simulate import Topology, simulate
    from tandem.plan.sizing import format_search, parse_slos, search

    if args.request_rate <= 0 or args.burstiness <= 0:
        raise InvalidParameterError("--request-rate", "and --burstiness must be > 0")
    if not args.search and args.slo:
        raise InvalidParameterError("--slo", "is for --search (one layout: --goodput)")
    if args.search and args.trace:
        raise InvalidParameterError("--trace", "draws one layout; leave it out of --search")
    if args.max_instances < 1:
        raise InvalidParameterError("--max-instances", "must be >= 1")
    slos = parse_goodput(args.goodput)
    config_model, params = read_model(args.model)
    dtype = args.dtype or ("fp32" if args.cost else "bf16")
    element = 4 if dtype == "fp32" else 2
    block = experts_block(args.model) if config_model.moe else 1
    shape = ModelShape.of(config_model, params, element, element, block)
    if args.cost:
        cost = StepCostModel.load(args.cost)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        hardware = PRESETS[args.hardware]
        cost = StepCostModel.from_hardware(hardware, dtype, args.tp, tp_link(args, hardware))
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
    topology = Topology(
        args.instances, args.prefill, args.decode, args.link_gbs, args.link_latency_ms / 1e3,
        args.local_prefill_threshold,
    )  # fmt: skip

    def run_layout(layout: Topology, trace: str | None = None):
        result = simulate(
            requests, gaps, shape, cost, config, num_blocks, max_model_len,
            config_model.vocab_size, trace, layout,
        )  # fmt: skip
        summary = summarize(result.results, result.duration, slos)
        summary.update(
            layout=layout.label, prefix_cache_hit_rate=result.prefix_cache_hit_rate,
            simulated_steps=result.num_steps, preemptions=result.num_preemptions,
            kv_transfers=result.num_transfers, num_blocks=num_blocks, cost_model=cost.source,
        )  # fmt: skip
        for role in result.busy_s:
            summary[f"{role}_utilization"] = result.utilization(role)
        return result, summary

    started = time.perf_counter()
    if args.search:
        search_slos = parse_slos(args.slo)
        best, rows = search(
            lambda layout: run_layout(layout)[1], search_slos, args.max_instances, topology
        )
        wall = time.perf_counter() - started
        if args.json:
            table = [
                {"layout": r.topology.label, "meets": r.meets(search_slos), "why": r.why,
                 **{key: (r.summary or {}).get(key) for key in search_slos}}
                for r in rows
            ]  # fmt: skip
            print(json.dumps({"best": best.topology.label if best else None, "rows": table}))
            return
        print(
            f"searched {len(rows)} layouts of {len(requests)} requests at "
            f"{_rate(args.request_rate)} req/s on {cost.source}, in {wall:.2f} s of wall time"
        )
        print(format_search(best, rows, search_slos))
        return
    result, summary = run_layout(topology, args.trace)
    summary["wall_seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))
        return
    busy = ", ".join(f"{role} {100 * result.utilization(role):.0f}% busy" for role in result.busy_s)
    transfers = f", {result.num_transfers:,} KV transfers" if topology.disaggregated else ""
    print(
        f"simulated: {len(requests)} requests at {_rate(args.request_rate)} req/s on "
        f"{topology.label} ({cost.source}); {result.num_steps:,} steps, {num_blocks:,} KV "
        f"blocks per instance, {result.num_preemptions} preemptions{transfers}, {busy}; "
        f"in {summary['wall_seconds']:.2f} s of wall time"
    )
    print(format_table(summary, slos))


def _rate(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


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
