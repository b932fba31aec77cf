"""A host that runs tensor-parallel ranks but not the engine (`tandem worker`).

Node ``node_rank`` of ``nnodes`` starts its ``tensor_parallel_size / nnodes`` ranks as
worker processes (worker.py), numbered after the hosts before it, pointed at node
0's rendezvous, once node 0's admission agrees with this host's settings and secret
(ranks.py); everything else (the model, its settings) they receive from rank 0.
Its ranks meet in a shared segment of this host (and over gloo with the other hosts'
ranks: runner/host_groups.py). It says so, then waits: it returns when its ranks end
(rank 0 stopped them, or went away), with the first failing rank's status; one rank
failing stops the others.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

from tandem.config import ParallelConfig
from tandem.executor import ranks


def serve_node(parallel: ParallelConfig) -> int:
    """Raises InvalidParameterError, naming it, for a setting that differs from node
    0's (node 0 then fails with the same line)."""
    local = parallel.ranks_per_node
    first = parallel.node_rank * local
    rendezvous = ranks.network_rendezvous(parallel.master_addr, parallel.master_port)
    env = {**os.environ, **ranks.admit_node(parallel)}
    print(
        f"tandem worker: node {parallel.node_rank} of {parallel.nnodes}, tensor-parallel "
        f"ranks {first}-{first + local - 1} of {parallel.tensor_parallel_size}; workers "
        f"only (node 0 at {parallel.master_addr}:{parallel.master_port} runs the engine)",
        flush=True,
    )
    segment = ranks.host_segment(local, f"node{parallel.node_rank}-{os.getpid()}")
    command = [
        ranks.worker_command(rendezvous, rank, parallel.tensor_parallel_size, segment)
        for rank in range(first, first + local)
    ]
    workers = [subprocess.Popen(argv, env=env) for argv in command]
    try:
        return wait_all(workers)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        if segment != ranks.NO_SEGMENT:  # (its first rank removes it once all have mapped it)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment)


def wait_all(workers: list[subprocess.Popen]) -> int:
    """0 once every worker ended well; else the first failing one's status, once the
    others are stopped too (their host's collectives cannot go on without it)."""
    while True:
        statuses = [worker.poll() for worker in workers]
        failed = next((status for status in statuses if status), None)
        if failed is not None:
            for worker in workers:
                if worker.poll() is None:
                    worker.terminate()
            return failed
        if all(status == 0 for status in statuses):
            return 0
        time.sleep(0.2)
