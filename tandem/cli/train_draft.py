"""``tandem train-draft``: train an EAGLE draft head for a target on the target's own
answers (tandem/train/draft_head.py), then serve with ``--speculative-method
eagle --draft-model OUT``. Interrupted, the same command goes on where it stopped."""

from __future__ import annotations

import argparse

from tandem.spec_decode.draft_settings import DraftTraining

HELP = "train an EAGLE draft head on the target's own answers (speculative method eagle)"
# The DraftTraining fields the command line sets (each flag's dest is the field's name).
FIELDS = ("prompts", "max_tokens", "steps", "batch_size", "lr", "draft_vocab_size", "seed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DraftTraining()
    parser.add_argument("--target", required=True, help="folder, GGUF file or catalog name")
    parser.add_argument("--out", required=True, metavar="DIR", help="the head's folder")
    parser.add_argument("--text", nargs="+", metavar="FILE", default=None,
                        help="documents whose paragraphs prompts are made of "
                             "(default: the Python standard library's docstrings)")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=defaults.prompts, metavar="N",
                        help="prompts the target answers for training")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, metavar="N",
                        help="per answer")  # fmt: skip
    parser.add_argument("--steps", type=int, default=defaults.steps, metavar="N")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, metavar="N")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab_size,
                        dest="draft_vocab_size", metavar="N",
                        help="tokens it can guess (the most common)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=defaults.seed)


def run(args: argparse.Namespace) -> None:
    import json

    from tandem.errors import InvalidParameterError
    from tandem.train.draft_head import train_draft

    for flag, name in (("--prompts", "prompts"), ("--max-tokens", "max_tokens"),
                       ("--steps", "steps"), ("--batch-size", "batch_size"),
                       ("--draft-vocab", "draft_vocab_size")):  # fmt: skip
        if getattr(args, name) < 1:
            raise InvalidParameterError(flag, "must be >= 1")
    if not args.lr > 0:  # (NaN too)
        raise InvalidParameterError("--lr", "must be > 0")
    settings = DraftTraining(**{name: getattr(args, name) for name in FIELDS})
    summary = train_draft(args.target, args.out, args.text, settings)
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}, indent=2))
    print(f"use: --speculative-method eagle --draft-model {args.out} --num-speculative-tokens 3")
