"""A host that runs tensor-parallel ranks but not the engine (`tandem worker`).

Node ``node_rank`` of ``nnodes`` starts its ``tensor_parallel_size / nnodes`` ranks as
worker processes (worker.py), numbered after the hosts before it, pointed at node
0's rendezvous, once node 0's admission agrees with this host's settings and secret
(ranks.py); everything else (the model, its settings) they receive from rank 0.
It says so, then waits: it returns when its ranks end (rank 0 stopped them, or went
away), with the first failing rank's status.
"""

from __future__ import annotations

import os
import subprocess

from tandem.config import ParallelConfig
from tandem.executor import ranks
from tandem.executor.worker import NO_SEGMENT


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
    workers = [
        subprocess.Popen(
            ranks.worker_command(rendezvous, rank, parallel.tensor_parallel_size, NO_SEGMENT),
            env=env,
        )
        for rank in range(first, first + local)
    ]
    statuses = [worker.wait() for worker in workers]
    return next((status for status in statuses if status), 0)
