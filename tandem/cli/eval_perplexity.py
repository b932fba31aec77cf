"""``tandem eval perplexity``: a model's perplexity on a local text, windowed and
scored as llama.cpp's ``llama-perplexity`` does (tandem/eval/windows.py)."""

from __future__ import annotations

import argparse

from tandem.cli.engine_args import add_engine_arguments, apply_threads, engine_options

HELP = "perplexity on a local text, as llama-perplexity computes it"


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", required=True, metavar="FILE", help="a local text file")
    parser.add_argument(
        "--ctx", type=int, default=512, metavar="TOKENS",
        help="window size; its second half is scored (default: 512)",
    )  # fmt: skip
    parser.add_argument(
        "--batch", type=int, default=None, metavar="TOKENS",
        help="run each window in chunks of this many tokens (default: whole); smaller "
        "chunks read earlier ones from the KV cache, so its dtype counts",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_eval_arguments(parser)
    add_engine_arguments(parser)


def load(model: str, args: argparse.Namespace, **overrides):
    from tandem import LLM

    return LLM(model, **{**engine_options(args), **overrides})


def report(figures: dict, as_json: bool) -> None:
    import json

    if as_json:
        print(json.dumps(figures, indent=2))
        return
    for name, value in figures.items():
        print(f"{name:<20}{value:.6g}" if isinstance(value, float) else f"{name:<20}{value}")


def run(args: argparse.Namespace) -> None:
    from tandem.cli.engine_args import model_or_default
    from tandem.eval.run import evaluate, text_tokens

    apply_threads(args)
    llm = load(model_or_default(args), args)
    tokens = text_tokens(llm, args.text)
    report(evaluate(llm, tokens, args.ctx, None, not args.no_progress, args.batch), args.json)
