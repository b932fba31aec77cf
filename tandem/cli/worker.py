"""``tandem worker``: this host's tensor-parallel ranks of an engine that runs on
another host (node 0, started with the same --tensor-parallel-size, --nnodes and
--master-port and --node-rank 0). Example, two hosts of 2 ranks each::

    host A: tandem serve --model M --tensor-parallel-size 4 --nnodes 2 --master-addr A \\
                --master-port 29500
    host B: tandem worker --tensor-parallel-size 4 --nnodes 2 --node-rank 1 \\
                --master-addr A --master-port 29500
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tandem.config import ParallelConfig

HELP = "run this host's tensor-parallel ranks for an engine on another host"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ParallelConfig):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        kind = type(f.default)
        parser.add_argument(
            flag, dest=f.name, type=kind, default=f.default, metavar=f.metadata.get("metavar"),
            help=f"{f.metadata['help']} (default: {f.default})",
        )  # fmt: skip


def run(args: argparse.Namespace) -> None:
    from tandem.errors import InvalidParameterError
    from tandem.executor.node import serve_node

    parallel = ParallelConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(ParallelConfig)}
    )
    if parallel.nnodes < 2 or parallel.node_rank == 0:
        raise InvalidParameterError(
            "node_rank", "tandem worker runs the ranks of another host: --nnodes >= 2 and "
            "--node-rank >= 1 (node 0 runs the engine: tandem serve or generate)",
        )  # fmt: skip
    status = serve_node(parallel)
    if status:
        sys.exit(status)
