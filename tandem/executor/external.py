"""Ranks started by an external launcher: every rank runs the same program.

    torchrun --nproc-per-node 2 my_script.py      (my_script: LLM(..., tensor_parallel_size=2,
                                                    distributed_executor_backend="external_launcher"))

torchrun sets RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and the rendezvous; each rank builds
its own engine around its shard, and since scheduling is deterministic (the same
requests added in the same order make the same steps), the ranks run the same steps
without a message between them and meet only in the model's collectives; every rank's
``generate`` returns the same outputs. So nothing whose decisions depend on time may
run: adaptive speculation is refused. Ranks on one host meet in shared memory, across
hosts over gloo; torchrun ends every rank when one fails. A rank that is alive but
never comes (stopped, deadlocked) is found by the waits: in shared memory as there,
over gloo by the group's timeout, the hang timeout once every rank has loaded (no
rank may then keep the others waiting longer than that between two steps; its
environment variable sets it).
"""

from __future__ import annotations

import os
import socket
import time

import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.errors import EngineDeadError, InvalidParameterError
from tandem.executor import ranks
from tandem.executor.local import LocalExecutor
from tandem.executor.step_channel import hung_after, set_hang_timeout
from tandem.runner.shm_group import ShmGroup, create_segment


def _peer_gone(pids: list[int]) -> str | None:
    for rank, pid in enumerate(pids):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            return f"tensor-parallel rank {rank} is gone"
        if state in ("Z", "X"):
            return f"tensor-parallel rank {rank} exited"
    return None


class ExternalLauncherExecutor(LocalExecutor):
    def __init__(self, config: EngineConfig) -> None:
        size = config.parallel.tensor_parallel_size
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise InvalidParameterError(
                "distributed_executor_backend",
                "external_launcher needs its ranks started by torchrun (RANK, WORLD_SIZE)",
            )
        if int(os.environ["WORLD_SIZE"]) != size:
            raise InvalidParameterError(
                "tensor_parallel_size",
                f"is {size} but torchrun started {os.environ['WORLD_SIZE']} ranks",
            )
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=ranks.IDLE)
        self.rank = rank = dist.get_rank()
        facts: list = [None] * size
        dist.all_gather_object(facts, (socket.gethostname(), os.getpid()))
        one_host = len({host for host, _ in facts}) == 1
        shm = None
        if one_host and ranks.shared_memory_usable():
            box = [create_segment(size, f"torchrun-{os.getpid()}") if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            peers = [pid for _, pid in facts]
            shm = ShmGroup(box[0], rank, size, lambda: _peer_gone(peers))
            dist.barrier()  # every rank has mapped it
            if rank == 0:
                os.unlink(box[0])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", size if one_host else 1))
        self.host_settings = ranks.HostSettings()
        super().__init__(ranks.build_rank(config, rank, shm, local))
        self.hang_timeout_s: float | None = None
        if shm is None:
            dist.barrier()  # every rank has loaded (loads differ in length)
            self.hang_timeout_s = set_hang_timeout(self.runner.tp.comm)

    def execute(self, scheduler_output):
        started = time.monotonic()
        try:
            return super().execute(scheduler_output)
        except RuntimeError as exc:  # a collective failed: a rank went away or hung
            hung = hung_after(started, self.hang_timeout_s)
            raise EngineDeadError(hung or f"a tensor-parallel collective failed: {exc}") from exc

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.host_settings.restore()
