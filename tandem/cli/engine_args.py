"""The engine flags of ``tandem generate`` and ``tandem serve``, generated from the
config dataclasses (tandem/config.py): one flag per field, its help text, metavar and
default from the field. Values the user leaves out are not passed, so the config's
own defaults (and its validation, naming the field) apply."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from tandem.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

# (config class, fields left out): the sections whose fields are flat engine options.
SECTIONS = [
    (EngineConfig, {"model", "cache", "scheduler", "speculative", "kv_transfer"}),
    (CacheConfig, set()),
    (SchedulerConfig, set()),
]


def _flags(cls: type) -> list[tuple[dataclasses.Field, str, type]]:
    """(field, flag, value type) for each field of ``cls``."""
    hints = typing.get_type_hints(cls)
    result = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        result.append((f, flag, kind))
    return result


def _add(group, f: dataclasses.Field, flag: str, kind: type, dest: str) -> None:
    text = f.metadata.get("help", "")
    if kind is bool:  # --flag / --no-flag
        state = "on" if f.default else "off"
        group.add_argument(
            flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
            help=f"{text} (default: {state})",
        )  # fmt: skip
        return
    default = f.default if f.default is not dataclasses.MISSING else None
    shown = f" (default: {default})" if default is not None and "default" not in text else ""
    group.add_argument(
        flag, dest=dest, type=kind, default=None, help=text + shown,
        metavar=f.metadata.get("metavar") or kind.__name__.upper(),
    )  # fmt: skip


def add_engine_arguments(parser: argparse.ArgumentParser, kv_transfer: bool = False) -> None:
    """The engine's flags; with ``kv_transfer``, the disaggregated-serving ones too."""
    parser.add_argument(
        "--model", default=None, metavar="DIR",
        help="a local Hugging Face model folder (default: the bundled stdlib-lm)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=0, metavar="N", help="CPU threads (0: torch's default)"
    )
    engine = parser.add_argument_group("engine")
    for cls, skipped in SECTIONS:
        for f, flag, kind in _flags(cls):
            if f.name not in skipped:
                _add(engine, f, flag, kind, f"engine_{f.name}")
    speculative = parser.add_argument_group(
        "speculative decoding", "on when --speculative-method is given"
    )
    for f, flag, kind in _flags(SpeculativeConfig):
        _add(speculative, f, flag, kind, f"speculative_{f.name}")
    if kv_transfer:
        disagg = parser.add_argument_group("disaggregated serving")
        for f, flag, kind in _flags(KVTransferConfig):
            _add(disagg, f, flag, kind, f"kv_transfer_{f.name}")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the user gave, as ``LLM(**options)`` / ``EngineConfig.from_kwargs``
    take them."""
    options = {
        f.name: getattr(args, f"engine_{f.name}")
        for cls, skipped in SECTIONS
        for f, _, _ in _flags(cls)
        if f.name not in skipped and getattr(args, f"engine_{f.name}") is not None
    }
    speculative = {
        f.name: getattr(args, f"speculative_{f.name}")
        for f, _, _ in _flags(SpeculativeConfig)
        if getattr(args, f"speculative_{f.name}") is not None
    }
    if "method" in speculative:
        options["speculative_config"] = speculative
    kv_transfer = {
        f.name: getattr(args, f"kv_transfer_{f.name}")
        for f, _, _ in _flags(KVTransferConfig)
        if getattr(args, f"kv_transfer_{f.name}", None) is not None
    }
    if kv_transfer:
        options["kv_transfer_config"] = kv_transfer
    return options


def apply_threads(args: argparse.Namespace) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
