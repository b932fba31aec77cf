"""``tandem pull MODEL``: download a Hugging Face model into the hub's cache, for later
use without the network (HF_HUB_OFFLINE=1): ``org/repo`` (its safetensors folder),
``org/repo:Q4_K_M`` or ``org/repo/file.gguf`` (a GGUF file). Prints the local path."""

from __future__ import annotations

import argparse

HELP = "download a Hugging Face model (org/repo[:Q4_K_M]) into the hub's cache"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="ORG/REPO[:TAG]", help="a Hugging Face model id")
    parser.add_argument("--revision", default=None, help="a branch, tag or commit")


def run(args: argparse.Namespace) -> None:
    from tandem.models.hub import resolve

    print(resolve(args.model, args.revision))
