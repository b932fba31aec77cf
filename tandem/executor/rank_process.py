"""A tensor-parallel worker: rank 1..N-1 of a model, started by the driver (rank 0).

    python -m tandem.executor.rank_process RENDEZVOUS RANK SIZE SEGMENT

It joins the group at the rendezvous (ranks.py), receives the engine config from
rank 0, maps its host's shared segment (a path, or ``-``: everything over gloo),
loads its shard, then runs every step rank 0 sends until told to stop or until rank 0 goes
away (it is no longer this process's parent, or its socket closes: the wait raises
and the worker exits) or hangs (step_channel.py: no step or beat within the hang
timeout).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch.distributed as dist

from tandem.executor import ranks
from tandem.executor.step_channel import StepChannel
from tandem.runner.shm_group import ShmGroup

logger = logging.getLogger("tandem.executor")

STOP = "stop"


def serve(rendezvous: str, rank: int, size: int, segment: str) -> int:
    parent = os.getppid()  # rank 0: a worker outlives it by no more than a wait

    def rank0_gone() -> str | None:
        return None if os.getppid() == parent else "tensor-parallel rank 0 is gone"

    ranks.join_as_worker(rendezvous, rank, size)
    try:
        config = ranks.receive_config()
        per_host = config.parallel.ranks_per_node
        shm = None
        if segment != ranks.NO_SEGMENT:  # the first rank of its host removes its name
            shm = ShmGroup(segment, rank % per_host, per_host, rank0_gone)
        one_host = config.parallel.nnodes == 1
        channel = StepChannel(shm if one_host else None, rank)
        prefix = ranks.shared_kv_prefix(config, rendezvous)
        runner = ranks.build_rank(config, rank, shm, per_host, prefix)
        channel.arm(runner.tp.comm)
        if shm is not None and rank % per_host == 0:  # every rank of the host has mapped it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment)
        while True:
            message = channel.receive()
            if message == STOP:
                return 0
            runner.execute(message)
    except Exception as exc:  # rank 0 is gone or hung, or this rank's load failed
        logger.debug("tensor-parallel rank %d ends: %s", rank, exc)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    rendezvous, rank, size, segment = sys.argv[1:5]
    sys.exit(serve(rendezvous, int(rank), int(size), segment))


if __name__ == "__main__":
    main()
