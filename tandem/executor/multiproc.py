"""Tensor parallelism: this process is rank 0, ranks 1..N-1 are worker processes.

    __init__   start this host's workers (python -m tandem.executor.rank_process; other
               hosts' come from `tandem worker` there, node.py), wait for every rank
               at the rendezvous, send them the config; every rank loads its shard
               (models/sharding.py) and sizes the same KV pool
    execute    send the step to every worker, run rank 0's share; the ranks meet in
               each layer's all-reduce and in the logits' all-gather (in shared memory,
               runner/shm_group.py, or over gloo), and rank 0's sampled tokens are the
               result (every rank samples the same ones)
    close      tell the workers to stop and wait for them

A worker that dies makes the step it was in raise (rank 0's wait in shared memory
sees the process gone; over gloo its socket closes and the collective fails at
once), and one that hangs makes it raise after the hang timeout (step_channel.py);
from then on every step raises the same error, naming the rank and its exit status
or the hang, so requests end with an error and never wait. On GPUs the ranks meet in
NCCL kernels, which wait on the GPU for a peer that never comes: a thread of rank 0
(``StepWatch``) checks the workers while a step is in flight and aborts the NCCL
group when one died or the step passed the hang timeout, so the step fails then.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time

import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.errors import EngineDeadError
from tandem.executor import ranks
from tandem.executor.local import LocalExecutor
from tandem.executor.rank_process import STOP
from tandem.executor.step_channel import StepChannel, hung_after
from tandem.runner.shared_kv import RankedKVCache, remove_files
from tandem.runner.shm_group import ShmGroup

logger = logging.getLogger("tandem.executor")


class StepWatch:
    """Rank 0 on GPUs: while a step is in flight (``since``: when it began), every
    WATCH_S the workers are checked (``dead``: why one is gone, or None) and the step
    against the hang timeout; on either, ``abort`` ends the step's collectives and
    ``problem`` says why (the executor raises it)."""

    WATCH_S = 0.05

    def __init__(self, dead, timeout_s, abort) -> None:
        self.dead, self.timeout_s, self.abort = dead, timeout_s, abort
        self.since: float | None = None
        self.problem: str | None = None
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="tandem-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopped.wait(self.WATCH_S):
            since = self.since
            if since is None:
                continue
            problem = self.dead() or hung_after(since, self.timeout_s())
            if problem is not None:
                self.problem = problem
                self.abort()
                return


class MultiprocExecutor(LocalExecutor):
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        size, local = parallel.tensor_parallel_size, parallel.ranks_per_node
        self.store_folder = None
        if parallel.nnodes == 1:
            rendezvous = ranks.local_rendezvous()
            self.store_folder = os.path.dirname(rendezvous.partition(":")[2])
            timeout_s = ranks.START_TIMEOUT_S
        else:  # the other hosts' ranks come from `tandem worker` there
            rendezvous = ranks.network_rendezvous(parallel.master_addr, parallel.master_port)
            timeout_s = ranks.REMOTE_START_TIMEOUT_S
            logger.info(
                "tensor parallelism over %d hosts: waiting for ranks %d-%d at %s:%d",
                parallel.nnodes, local, size - 1, parallel.master_addr, parallel.master_port,
            )  # fmt: skip
            if not os.environ.get(ranks.SECRET_ENV):
                logger.warning(
                    "%s is not set: any host that reaches port %d can join this group "
                    "(docs/SECURITY.md)", ranks.SECRET_ENV, parallel.master_port,
                )  # fmt: skip
        # Shared memory joins the ranks of a host; hosts meet over gloo.
        segment = ranks.host_segment(local, str(os.getpid()))
        shared = segment != ranks.NO_SEGMENT
        meeting = ranks.host_meeting(rendezvous, parallel)
        env = {**os.environ, **meeting.worker_env}
        self.workers = [
            subprocess.Popen(ranks.worker_command(rendezvous, rank, size, segment), env=env)
            for rank in range(1, local)
        ]
        self.broken: str | None = None
        self.closed = False
        self.watch: StepWatch | None = None
        self.host_settings = ranks.HostSettings()
        kv_prefix = None
        try:
            ranks.join_as_driver(meeting, size, self._dead_worker, timeout_s)
            shm = ShmGroup(segment, 0, local, self._dead_worker) if shared else None
            self.channel = StepChannel(shm if parallel.nnodes == 1 else None, 0)
            ranks.send_config(config)
            kv_prefix = ranks.shared_kv_prefix(config, rendezvous)
            super().__init__(ranks.build_rank(config, 0, shm, local, kv_prefix))
            # A disaggregated role's connector moves every rank's blocks from here.
            self.kv_cache = self.runner.kv_cache
            if kv_prefix is not None:
                self.kv_cache = RankedKVCache.open(
                    kv_prefix, self.runner.kv_cache, self.runner.loaded.shard.full, size
                )
            self.channel.arm(self.runner.tp.comm)
            if ranks.on_gpus(config):
                self.watch = StepWatch(
                    self._dead_worker, lambda: self.channel.timeout_s, self.runner.tp.comm.abort
                )
        except BaseException:
            if kv_prefix is not None:
                remove_files(kv_prefix)
            self._stop_workers(grace_s=2.0)
            self._remove_store()
            self.host_settings.restore()
            raise
        finally:
            if shared:  # every rank has mapped it (they met in the load's collectives)
                os.unlink(segment)
        atexit.register(self.close)

    def execute(self, scheduler_output):
        watch = self.watch
        if self.broken is None:
            self.broken = self._dead_worker() or self.channel.failure or (watch and watch.problem)
        if self.broken is not None:
            raise EngineDeadError(self.broken)
        with self.channel.turn():
            started = time.monotonic()
            if watch is not None:
                watch.since = started
            try:
                self.channel.send(scheduler_output)
                output = super().execute(scheduler_output)
            except RuntimeError as exc:  # a rank went away, hung, or failed mid-step
                self.channel.stop_beats()
                self.broken = (
                    (watch and watch.problem)
                    or self._dead_worker()
                    or hung_after(started, self.channel.timeout_s)
                    or f"a tensor-parallel step failed: {exc}"
                )
                raise EngineDeadError(self.broken) from exc
            finally:
                if watch is not None:
                    watch.since = None
            if watch is not None and watch.problem is not None:  # aborted as it ended
                self.broken = watch.problem
                raise EngineDeadError(self.broken)
            return output

    def _dead_worker(self) -> str | None:
        for rank, worker in enumerate(self.workers, start=1):
            if worker.poll() is not None:
                return f"tensor-parallel rank {rank} exited with status {worker.returncode}"
        return None

    def close(self) -> None:
        """Stop every rank, this host's and other hosts' (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.watch is not None:
            self.watch.stopped.set()
        self.channel.close()
        if self.broken is None and self.channel.failure is None and self._dead_worker() is None:
            with contextlib.suppress(RuntimeError), self.channel.turn():  # (one went away)
                self.channel.send(STOP)
        self.broken = self.broken or "the tensor-parallel ranks were stopped (closed)"
        self._stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._remove_store()
        self.host_settings.restore()

    def _remove_store(self) -> None:
        if self.store_folder is not None:
            shutil.rmtree(self.store_folder, ignore_errors=True)
            self.store_folder = None

    def _stop_workers(self, grace_s: float = 10.0) -> None:
        for worker in self.workers:
            try:
                worker.wait(grace_s)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        self.workers = []
