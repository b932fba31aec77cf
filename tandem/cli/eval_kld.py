"""``tandem eval kld``: how far a model's next-token distributions are from a
reference's on a local text (the same weights in float32, another quantization, a
KV-cache dtype...): KL divergence, same top token, delta p and the perplexity ratio,
with llama.cpp's definitions (tandem/eval/scores.py). The reference's log-probs can
be saved once (``--save-reference``) and reused (``--reference-file``)."""

from __future__ import annotations

import argparse

from tandem.cli.engine_args import add_engine_arguments, apply_threads, model_or_default
from tandem.cli.eval_perplexity import add_eval_arguments, load, report
from tandem.errors import InvalidParameterError

HELP = "KL divergence and friends of a model against a reference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_eval_arguments(parser)
    reference = parser.add_argument_group("the reference")
    reference.add_argument("--reference", metavar="MODEL", help="a model (name, folder, GGUF)")
    reference.add_argument(
        "--reference-quantization", default="none", metavar="TYPE",
        help="how the reference's weights run (default: none, i.e. dequantized to "
        "float: the float reference of a quantized file)",
    )  # fmt: skip
    reference.add_argument(
        "--reference-file", metavar="FILE", help="log-probs saved by --save-reference"
    )
    reference.add_argument(
        "--save-reference", metavar="FILE", help="save the reference's log-probs there"
    )
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> None:
    from tandem.eval.run import (
        evaluate,
        load_reference,
        reference_log_probs,
        save_reference,
        text_tokens,
    )

    if (args.reference is None) == (args.reference_file is None):
        raise InvalidParameterError("--reference", "give exactly one of it and --reference-file")
    apply_threads(args)
    progress = not args.no_progress
    model = model_or_default(args)
    if args.reference_file is not None:
        reference = load_reference(args.reference_file)
    else:
        ref_llm = load(args.reference, args, quantization=args.reference_quantization)
        tokens = text_tokens(ref_llm, args.text)
        reference = reference_log_probs(ref_llm, tokens, args.ctx, progress, args.batch)
        del ref_llm
        if args.save_reference:
            save_reference(reference, args.save_reference)
    llm = load(model, args)
    tokens = text_tokens(llm, args.text)
    report(evaluate(llm, tokens, args.ctx, reference, progress, args.batch), args.json)
