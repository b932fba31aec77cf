"""``tandem models``: the Hugging Face models in the hub's cache (HF_HOME), with their
size on disk and formats: what ``--model org/repo`` loads without the network."""

from __future__ import annotations

import argparse

HELP = "list the Hugging Face models in the local cache"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> None:
    from huggingface_hub import constants

    from tandem.models.hub import cached_models

    models = cached_models()
    if not models:
        print(f"no models in {constants.HF_HUB_CACHE}")
        return
    width = max(len(m.repo_id) for m in models)
    print(f"{'model':<{width}}  {'size':>9}  formats")
    for m in models:
        size = (
            f"{m.size_bytes / 1e9:.2f} GB"
            if m.size_bytes >= 1e8
            else f"{m.size_bytes / 1e6:.1f} MB"
        )
        print(f"{m.repo_id:<{width}}  {size:>9}  {', '.join(m.formats) or '-'}")
