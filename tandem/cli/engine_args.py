"""The engine flags of ``tandem generate`` and ``tandem serve``, generated from the
config dataclasses (tandem/config.py): one flag per field, its help text, metavar and
default from the field. Values the user leaves out are not passed, so the config's
own defaults (and its validation, naming the field) apply."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

from tandem.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class FlagGroup:
    """Config sections whose fields become one group of flags; ``option`` is the
    keyword they are passed under (None: flat engine options)."""

    name: str
    title: str
    sections: tuple[type, ...]
    option: str | None = None
    # Fields that are sections themselves, not settings.
    skipped: frozenset[str] = frozenset()


ENGINE = FlagGroup(
    "engine", "engine", (EngineConfig, CacheConfig, SchedulerConfig, ParallelConfig),
    skipped=frozenset({"model", "cache", "scheduler", "parallel", "speculative", "kv_transfer"}),
)  # fmt: skip
SPECULATIVE = FlagGroup(
    "speculative", "speculative decoding", (SpeculativeConfig,), "speculative_config"
)
KV_TRANSFER = FlagGroup(
    "kv_transfer", "disaggregated serving", (KVTransferConfig,), "kv_transfer_config"
)


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


def _fields(group: FlagGroup) -> list[tuple[dataclasses.Field, str, type]]:
    return [
        entry
        for cls in group.sections
        for entry in _flags(cls)
        if entry[0].name not in group.skipped
    ]


def _flag(group: FlagGroup, name: str) -> str:
    return next(flag for f, flag, _ in _fields(group) if f.name == name)


def _groups(kv_transfer: bool) -> list[FlagGroup]:
    return [ENGINE, SPECULATIVE, *([KV_TRANSFER] if kv_transfer else [])]


def add_engine_arguments(parser: argparse.ArgumentParser, kv_transfer: bool = False) -> None:
    """The engine's flags; with ``kv_transfer``, the disaggregated-serving ones too."""
    parser.add_argument(
        "--model", default=None, metavar="MODEL",
        help="a local Hugging Face model folder, a GGUF file (or a folder holding one), a "
        "Hugging Face id (org/repo, org/repo:Q4_K_M, org/repo/file.gguf: downloaded into "
        "the hub's cache), or smollm2-135m-instruct (default: SmolLM2 when installed, "
        "else the bundled stdlib-lm)",
    )  # fmt: skip
    parser.add_argument(
        "--revision", default=None, metavar="REV",
        help="with a Hugging Face id: the branch, tag or commit (default: main)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=0, metavar="N",
        help="CPU threads (0: torch's default; with --data-parallel-size, each core's, "
        "by default its share of the CPUs)",
    )  # fmt: skip
    for group in _groups(kv_transfer):
        arguments = parser.add_argument_group(group.title)
        for f, flag, kind in _fields(group):
            _add(arguments, f, flag, kind, f"{group.name}_{f.name}")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the user gave, as ``LLM(**options)`` / ``EngineConfig.from_kwargs``
    take them."""
    options: dict[str, Any] = {}
    for group in (ENGINE, SPECULATIVE, KV_TRANSFER):
        given = {
            f.name: value
            for f, _, _ in _fields(group)
            if (value := getattr(args, f"{group.name}_{f.name}", None)) is not None
        }
        if group is SPECULATIVE and given and "method" not in given:
            raise InvalidParameterError(
                "speculative_config",
                f"{', '.join(_flag(group, name) for name in given)} needs --speculative-method",
            )
        if group.option is None:
            options.update(given)
        elif given:
            options[group.option] = given
    return options


def model_or_default(args: argparse.Namespace) -> str:
    """``--model`` (a Hugging Face id downloaded, or found in the cache, first: the
    local path), or the default model, saying on stderr which it is."""
    if args.model:
        from tandem.models.hub import parse_hub_id, resolve

        if parse_hub_id(args.model) is not None:
            return str(resolve(args.model, getattr(args, "revision", None)))
        return args.model
    from tandem.models.catalog import default_model_choice

    model, message = default_model_choice()
    print(f"tandem: {message}", file=sys.stderr)
    return model


def checked_threads(args: argparse.Namespace) -> int:
    """``--threads``, refused if negative (0: torch's default)."""
    if args.threads < 0:
        raise InvalidParameterError(
            "--threads", f"must be >= 0 (0: torch's default), got {args.threads}"
        )
    return args.threads


def apply_threads(args: argparse.Namespace) -> None:
    if checked_threads(args):
        import torch

        torch.set_num_threads(args.threads)
