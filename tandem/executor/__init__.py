"""Between the engine core and the model: who runs each step's forward.

    local.py        one process: the steps run on this process's runner (the worker,
                    tandem/worker/, loads it and sizes its cache)
    multiproc.py    tensor parallelism: this process is rank 0 and starts ranks
                    1..N-1 as processes of their own (worker.py; other hosts' with
                    `tandem worker`, node.py); every step's SchedulerOutput goes to all
                    of them, each runs its shard of the forward, and rank 0's sampled
                    tokens are the step's result
    external.py     ranks started by torchrun, each running the same program with its
                    own engine; deterministic scheduling keeps them in step

Each implements tandem/step.py's Executor. Whoever builds an engine calls
``make_executor`` and hands the result over; the engine never learns how many
processes there are.
"""

from __future__ import annotations

from tandem.config import EngineConfig
from tandem.errors import InvalidParameterError
from tandem.step import Executor


def make_executor(config: EngineConfig) -> Executor:
    """The executor the config asks for: one process, or tensor-parallel ranks."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        from tandem.executor.local import LocalExecutor
        from tandem.worker.worker import build_runner

        return LocalExecutor(build_runner(config))
    check_parallel(config)
    if config.parallel.distributed_executor_backend == "external_launcher":
        from tandem.executor.external import ExternalLauncherExecutor

        return ExternalLauncherExecutor(config)
    from tandem.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)


def check_gpus(config: EngineConfig) -> None:
    """Ranks on GPUs: device ``cuda`` (each host's ranks take its GPUs 0..N-1, as
    CUDA_VISIBLE_DEVICES numbers them), enough GPUs on this host, NCCL, and a
    colocated engine (a disaggregated role's ranks share their KV caches through
    host memory)."""
    import torch
    import torch.distributed as dist

    local = config.parallel.ranks_per_node
    if config.device != "cuda":
        raise InvalidParameterError(
            "device", f"{config.device!r} with tensor parallelism: use cuda (rank r of a "
            "host takes its GPU r; CUDA_VISIBLE_DEVICES picks them) or cpu",
        )  # fmt: skip
    if torch.cuda.device_count() < local:
        raise InvalidParameterError(
            "tensor_parallel_size", f"{local} ranks on this host need {local} GPUs; torch "
            f"sees {torch.cuda.device_count()}",
        )  # fmt: skip
    if not dist.is_nccl_available():
        raise InvalidParameterError(
            "tensor_parallel_size", "ranks on GPUs meet over NCCL, which this build of "
            "torch does not have",
        )  # fmt: skip
    if config.kv_transfer is not None and config.kv_transfer.role != "both":
        raise InvalidParameterError(
            "kv_transfer_config.role", "a disaggregated role runs tensor-parallel ranks "
            "on CPUs only (they share their KV caches through host memory)",
        )  # fmt: skip


def check_parallel(config: EngineConfig) -> None:
    """Refuse, by name, what tensor parallelism does not run (yet), before any rank
    starts."""
    if config.device != "cpu":
        check_gpus(config)
    if config.kv_transfer is not None and config.kv_transfer.role != "both":
        if config.parallel.nnodes > 1:
            raise InvalidParameterError(
                "nnodes", "a disaggregated role's ranks share one host (rank 0 moves every "
                "rank's KV blocks through shared memory)",
            )  # fmt: skip
        if config.kv_transfer.backend == "nixl":
            raise InvalidParameterError(
                "kv_transfer_config.backend", "nixl moves one rank's cache: use zmq with "
                "tensor_parallel_size > 1",
            )  # fmt: skip
    from tandem.models.loader import read_config
    from tandem.models.sharding import ShardPlan

    _, model_config, _ = read_config(config.model)
    size = config.parallel.tensor_parallel_size
    for rank in range(size):  # a layout that leaves a rank nothing fails here, not in N loads
        _ = ShardPlan(model_config, rank, size).heads
    speculative = config.speculative
    external = config.parallel.distributed_executor_backend == "external_launcher"
    if external and speculative is not None and speculative.adaptive:
        raise InvalidParameterError(
            "speculative_config.adaptive",
            "ranks of an external launcher schedule alone and must make the same "
            "decisions: speculation that switches on measured time cannot run there "
            "(set adaptive to false)",
        )
