"""The ``tandem`` command line: one module per subcommand, each an ``add_arguments``
/ ``run`` pair (engine flags come from the config dataclasses, engine_args.py)."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from tandem.cli import (
    bench,
    chat,
    eval_kld,
    eval_perplexity,
    generate,
    models,
    plan,
    pull,
    quantize,
    router,
    serve,
    simulate,
    trace,
    train_draft,
    tune_layer_skip,
    worker,
)
from tandem.errors import TandemError

DESCRIPTION = """\
tandem: an LLM inference engine you can read. Paged KV cache, continuous batching,
chunked prefill, prefix caching, speculative decoding and disaggregated serving,
on a CPU or a CUDA GPU, measured in TTFT, TPOT and goodput."""

EPILOG = """\
examples:
  tandem chat "Name three primary colors."   (no message: an interactive chat)
  tandem generate "import os" --max-tokens 32 --model stdlib-lm
  tandem serve --port 8000                  (then any OpenAI client at /v1)
  tandem serve --model Qwen/Qwen3-0.6B       (or org/repo:Q4_K_M: a GGUF repository's file)
  tandem pull org/repo:Q4_K_M               (download only; tandem models lists the cache)
  tandem bench serve --base-url http://127.0.0.1:8000 --num-prompts 50
  tandem plan --model DIR --hardware h100-sxm --prompt-len 2048
  tandem quantize DIR model-q4_0.gguf --type q4_0   (then --model model-q4_0.gguf)
  tandem eval kld --model smollm2-135m-instruct --reference smollm2-135m-instruct --text F
'help' of each: tandem COMMAND --help"""


def _version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given ``argv``, only the command it names gets its
    arguments (the others are listed by name and help). A command's arguments can
    import what it needs (the quantizer's formats import torch, 2-3 s), and `tandem
    router` or `tandem --help` should not wait for what another command needs."""
    chosen = [word for word in (argv or []) if not word.startswith("-")][:2]
    parser = argparse.ArgumentParser(
        prog="tandem",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(subparsers, name: str, module, group: str | None = None) -> None:
        description = module.__doc__.replace("``", "").strip()
        sub = subparsers.add_parser(name, help=module.HELP, description=description)
        path = [group, name] if group else [name]
        shared = min(len(path), len(chosen))
        if argv is None or (chosen and path[:shared] == chosen[:shared]):
            module.add_arguments(sub)
        sub.set_defaults(func=module.run)

    add(commands, "chat", chat)
    add(commands, "generate", generate)
    add(commands, "serve", serve)
    add(commands, "router", router)
    add(commands, "worker", worker)
    benchmarks = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True, metavar="BENCHMARK"
    )
    add(benchmarks, "serve", bench, "bench")
    evals = commands.add_parser("eval", help="quality on a local text").add_subparsers(
        dest="eval_command", required=True, metavar="METRIC"
    )
    add(evals, "perplexity", eval_perplexity, "eval")
    add(evals, "kld", eval_kld, "eval")
    add(commands, "plan", plan)
    add(commands, "simulate", simulate)
    add(commands, "quantize", quantize)
    add(commands, "pull", pull)
    add(commands, "models", models)
    add(commands, "tune-layer-skip", tune_layer_skip)
    add(commands, "train-draft", train_draft)
    traces = commands.add_parser("trace", help="step traces").add_subparsers(
        dest="trace_command", required=True, metavar="ACTION"
    )
    add(traces, "plot", trace, "trace")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
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
