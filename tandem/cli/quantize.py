"""``tandem quantize``: write a Hugging Face checkpoint as a GGUF file, its linear
layers in one of llama.cpp's formats (tandem/models/gguf_export.py). The file loads in
tandem (``--model OUT.gguf``, weights kept quantized) and in llama.cpp."""

from __future__ import annotations

import argparse

HELP = "write a Hugging Face folder as a quantized GGUF file (llama.cpp's formats)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.models.gguf_export import EXPORT_TYPES

    parser.add_argument("model", metavar="DIR", help="a Hugging Face model folder")
    parser.add_argument("out", metavar="OUT.gguf", help="the file to write")
    parser.add_argument(
        "--type", default="q8_0", choices=list(EXPORT_TYPES),
        help="the matrices' format (norms stay float32): default q8_0",
    )  # fmt: skip
    parser.add_argument(
        "--split-max-tensors", type=int, default=0, metavar="N",
        help="write parts of at most N tensors (OUT-00001-of-0000K.gguf ..., as llama.cpp's "
        "gguf-split); tandem and llama.cpp load a split model from its first part",
    )  # fmt: skip


def run(args: argparse.Namespace) -> None:
    from pathlib import Path

    from tandem.models.gguf_export import export_gguf

    out = export_gguf(args.model, args.out, args.type, split_max_tensors=args.split_max_tensors)
    print(f"wrote {out} ({Path(out).stat().st_size / 1e6:.1f} MB, {args.type})")
