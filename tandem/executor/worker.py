"""A tensor-parallel worker: rank 1..N-1 of a model, started by the driver (rank 0).

    python -m tandem.executor.worker ADDRESS PORT RANK SIZE

It joins the group, receives the engine config from rank 0, loads its shard, then
runs every step rank 0 sends until told to stop or until rank 0 goes away (its
socket closes: the broadcast raises and the worker exits).
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

from tandem.executor import ranks

logger = logging.getLogger("tandem.executor")

STOP = "stop"


def serve(address: str, port: int, rank: int, size: int) -> int:
    ranks.join_as_worker(address, port, rank, size)
    try:
        config = ranks.receive()
        runner = ranks.build_runner(config, rank, size)
        while True:
            message = ranks.receive()
            if message == STOP:
                return 0
            runner.execute(message)
    except Exception as exc:  # rank 0 is gone, or this rank's load failed (rank 0 says why)
        logger.debug("tensor-parallel rank %d ends: %s", rank, exc)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    address, port, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sys.exit(serve(address, port, rank, size))


if __name__ == "__main__":
    main()
