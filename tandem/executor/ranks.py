"""What every tensor-parallel rank does the same way: join the group, split the CPU
threads, build its runner, and pass each step's message from rank 0 to the others.

The group is torch.distributed's gloo. The ranks meet at a store: a file on one
host, node 0's TCP store across hosts; each worker writes ``ready/<rank>`` there once
it is running, so rank 0 can tell a worker that died while starting (it polls its
processes while it waits) from one that is slow. Collectives wait without a deadline
(``IDLE``) while the ranks load, then with the hang timeout (step_channel.py). A rank
that dies breaks the others' sockets: their collective raises at once (never a hang),
and rank 0 fails the step and every one after it.

The config goes to the workers once over gloo. The model's collectives and each
step's message (the SchedulerOutput, pickled) go through a shared-memory segment
(runner/shm_group.py) where the compiled kernels are there (a collective over gloo's
loopback costs many times more); without them, over gloo.
benchmarks/tensor_parallel.py times both.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.executor.cpus import allowed_cpus, bind_memory, numa_nodes, pin_threads, rank_cpus
from tandem.runner.shm_group import ShmGroup, create_segment

logger = logging.getLogger("tandem.executor")

IDLE = datetime.timedelta(days=365)  # collectives while the ranks load
START_TIMEOUT_S = 120.0  # for every rank on this host to reach the rendezvous
REMOTE_START_TIMEOUT_S = 900.0  # ... and for other hosts' ranks (started by hand)
NO_SEGMENT = "-"  # a worker's segment argument: its host's ranks meet over gloo


def local_rendezvous() -> str:
    """One host: a file store in a fresh private folder (no port is opened), and the
    ranks' gloo sockets on the loopback interface."""
    loopback = next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)  # inherited by the workers
    return "file:" + os.path.join(tempfile.mkdtemp(prefix="tandem-tp-"), "store")


def network_rendezvous(address: str, port: int) -> str:
    """Several hosts: node 0's TCP store (it listens on ``port`` on every interface,
    as torchrun's does; gloo picks its interface from GLOO_SOCKET_IFNAME or the host
    name)."""
    return f"tcp:{address}:{port}"


def _store(rendezvous: str, size: int, is_master: bool) -> dist.Store:
    kind, _, where = rendezvous.partition(":")
    if kind == "file":
        return dist.FileStore(where, size)
    host, _, port = where.rpartition(":")
    return dist.TCPStore(host, int(port), size, is_master=is_master, wait_for_workers=False,
                         timeout=IDLE)  # fmt: skip


# -- admission across hosts ------------------------------------------------------------
#
# Node 0 posts what its group is (tensor-parallel size, hosts) and a nonce, with a
# proof that it holds the deployment's secret ($TANDEM_DIST_SECRET, empty if unset).
# Another host joins only if its settings and its secret agree, else it posts why
# it refused and node 0 fails with that line. The group itself meets under a store
# prefix derived from the secret and the nonce: a host without the secret cannot
# find it. (gloo's traffic is not encrypted: ranks belong on a trusted network.)

SECRET_ENV = "TANDEM_DIST_SECRET"
GROUP_ENV = "TANDEM_DIST_GROUP"  # the group's store prefix, handed to a host's workers
ADMISSION, REFUSED = "tandem/admission", "tandem/refused"
AGREED = (("tensor_parallel_size", "--tensor-parallel-size"), ("nnodes", "--nnodes"))


def _proof(purpose: str, nonce: str) -> str:
    key = hashlib.sha256(b"tandem-dist:" + os.environ.get(SECRET_ENV, "").encode()).digest()
    return hmac.new(key, f"{purpose}:{nonce}".encode(), hashlib.sha256).hexdigest()


@dataclasses.dataclass
class Meeting:
    """Where rank 0 meets the others: ``group`` for the ranks (a file store on one host;
    node 0's TCP store under the group's prefix across hosts), ``lobby`` where other
    hosts post refusals, ``worker_env`` what this host's workers need to join."""

    group: dist.Store
    lobby: dist.Store | None = None
    worker_env: dict[str, str] = dataclasses.field(default_factory=dict)


def host_meeting(rendezvous: str, parallel) -> Meeting:
    """Rank 0's side: the store, and across hosts the admission posted on it."""
    size = parallel.tensor_parallel_size
    if not rendezvous.startswith("tcp:"):
        return Meeting(_store(rendezvous, size, is_master=True))
    lobby = _store(rendezvous, size, is_master=True)
    nonce = secrets.token_hex(16)
    posted = {name: getattr(parallel, name) for name, _ in AGREED}
    lobby.set(ADMISSION, json.dumps({**posted, "nonce": nonce, "proof": _proof("node0", nonce)}))
    prefix = "tandem/" + _proof("group", nonce)[:32]
    return Meeting(dist.PrefixStore(prefix, lobby), lobby, {GROUP_ENV: prefix})


def admit_node(parallel) -> dict[str, str]:
    """Another host's side, before it starts its ranks: node 0's admission checked
    against this host's settings (InvalidParameterError naming the first that
    differs, posted for node 0 too); the environment its workers join with."""
    rendezvous = network_rendezvous(parallel.master_addr, parallel.master_port)
    lobby = _store(rendezvous, parallel.tensor_parallel_size, is_master=False)
    admission = json.loads(lobby.get(ADMISSION))
    here = f"node {parallel.node_rank}"
    for name, flag in AGREED:
        if admission[name] != getattr(parallel, name):
            _refuse(lobby, flag, f"{getattr(parallel, name)} on {here}, {admission[name]} on "
                                 "node 0 (every host must give the same)")  # fmt: skip
    if not hmac.compare_digest(admission["proof"], _proof("node0", admission["nonce"])):
        _refuse(lobby, f"${SECRET_ENV}", f"differs between {here} and node 0")
    return {GROUP_ENV: "tandem/" + _proof("group", admission["nonce"])[:32]}


def _refuse(lobby: dist.Store, setting: str, reason: str) -> None:
    lobby.set(REFUSED, f"{setting}: {reason}")
    raise InvalidParameterError(setting, reason)


def join_as_driver(
    meeting: Meeting, size: int, alive: Callable[[], str | None], timeout_s: float
) -> None:
    """Rank 0: wait for every other rank at the rendezvous (``alive`` says why a
    worker of this host died, or None; another host may refuse to join, saying why),
    then join the group."""
    store = meeting.group
    deadline = time.monotonic() + timeout_s
    keys = [f"ready/{rank}" for rank in range(1, size)]
    while not all(store.check([key]) for key in keys):
        problem = alive()
        if problem is not None:
            raise ModelLoadError(f"a tensor-parallel worker did not start: {problem}")
        if meeting.lobby is not None and meeting.lobby.check([REFUSED]):
            refusal = meeting.lobby.get(REFUSED).decode()
            raise ModelLoadError(f"another host refused to join: {refusal}")
        if time.monotonic() > deadline:
            missing = [k.split("/")[1] for k in keys if not store.check([k])]
            raise ModelLoadError(
                f"tensor-parallel rank(s) {', '.join(missing)} did not join in {timeout_s:.0f} s"
            )
        time.sleep(0.05)
    dist.init_process_group("gloo", store=store, rank=0, world_size=size, timeout=IDLE)


def join_as_worker(rendezvous: str, rank: int, size: int) -> None:
    store = _store(rendezvous, size, is_master=False)
    if rendezvous.startswith("tcp:"):
        store = dist.PrefixStore(os.environ[GROUP_ENV], store)
    store.set(f"ready/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=IDLE)


def worker_command(rendezvous: str, rank: int, size: int, segment: str) -> list[str]:
    return [sys.executable, "-m", "tandem.executor.rank_process", rendezvous, str(rank), str(size),
            segment]  # fmt: skip


def split_threads(ranks_on_host: int, local_rank: int, bind: bool) -> None:
    """This rank's share of the host's CPUs: a disjoint run of them when ``bind`` (every
    thread of the process pinned there, later ones inheriting it) and there are as many
    CPUs as ranks, on a NUMA node of its own with its memory bound there where the
    ranks spread evenly over several (cpus.rank_cpus); torch's threads, one per CPU of
    the share."""
    cpus = allowed_cpus()
    if not cpus:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_host))
        return
    share, node = [], None
    if bind and ranks_on_host > 1:
        share, node = rank_cpus(cpus, ranks_on_host, local_rank, numa_nodes(cpus))
    if share:
        pin_threads(share)
        if node is not None and bind_memory(node):
            logger.info("tensor-parallel rank %d: NUMA node %d, CPUs %s", local_rank, node, share)
        torch.set_num_threads(len(share))
        return
    torch.set_num_threads(max(1, len(cpus) // ranks_on_host))


class HostSettings:
    """The process-wide settings a rank changes (CPU affinity of every thread, torch's
    thread count), to put back when the ranks stop: rank 0 may be a process that goes
    on (a test, a notebook)."""

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()
        self.cpus = allowed_cpus()

    def restore(self) -> None:
        torch.set_num_threads(self.threads)
        if self.cpus:
            pin_threads(self.cpus)
        if len(numa_nodes(self.cpus)) > 1:
            bind_memory(None)


def shared_memory_usable() -> bool:
    """Whether ranks on this host meet in shared memory (runner/shm_group.py; its
    counters are compiled kernels) rather than over gloo (TANDEM_TP_SHM=0 forces
    gloo, for comparisons)."""
    from tandem.kernels import cpu as cpu_kernels

    return os.environ.get("TANDEM_TP_SHM", "1") != "0" and cpu_kernels.load() is not None


def build_rank(
    config: EngineConfig,
    rank: int,
    shm: ShmGroup | None,
    ranks_on_host: int,
    kv_prefix: str | None = None,
):
    """This rank's runner, its collectives in shared memory or over gloo, the host's
    CPUs split between its ``ranks_on_host`` (ranks of a host are numbered in a run);
    ``kv_prefix``: its KV cache in a shared-memory file there (shared_kv_prefix)."""
    from tandem.runner.shared_kv import kv_file
    from tandem.runner.tensor_parallel import TensorParallel
    from tandem.worker.worker import build_runner

    split_threads(ranks_on_host, rank % ranks_on_host, config.parallel.cpu_bind == "auto")
    size = config.parallel.tensor_parallel_size
    own = None if kv_prefix is None else kv_file(kv_prefix, rank)
    if on_gpus(config):
        device, comm = gpu_collectives(rank % ranks_on_host)
        tp = TensorParallel(rank, size, comm, kv_file=own, device=device)
    else:
        tp = TensorParallel(rank, size, model_collectives(config, rank, shm), kv_file=own)
    return build_runner(config, tp)


def on_gpus(config: EngineConfig) -> bool:
    return torch.device(config.device).type == "cuda"


def gpu_collectives(local_rank: int):
    """A rank on GPUs: this host's GPU ``local_rank`` becomes the process's device
    (``cuda`` means it from here on), and the model's collectives run over NCCL in a
    group of every rank. The world group stays gloo: the config, each step's message
    and setup's rare collectives go there, on the CPU. A collective that fails (a peer
    gone, or past the hang timeout once armed) aborts NCCL's communicator and raises
    in this process rather than ending it (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, unless
    the environment says otherwise), so rank 0 ends its step with an error."""
    from tandem.runner.tensor_parallel import DistCollectives

    torch.cuda.set_device(local_rank)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    group = dist.new_group(backend="nccl", timeout=IDLE)  # (every rank makes it)
    return torch.device("cuda", local_rank), DistCollectives(group)


def model_collectives(config: EngineConfig, rank: int, shm: ShmGroup | None):
    """Where a CPU model's collectives go: one host's segment; on several hosts, each
    host's segment and gloo between them (runner/host_groups.py) where every host has
    one (several ranks and the compiled kernels); else gloo alone."""
    from tandem.runner.host_groups import HostGroups
    from tandem.runner.tensor_parallel import DistCollectives

    parallel = config.parallel
    if parallel.nnodes == 1:
        return shm if shm is not None else DistCollectives()
    per_host = parallel.ranks_per_node
    leaders = list(range(0, parallel.tensor_parallel_size, per_host))
    group = dist.new_group(leaders, timeout=IDLE)  # (every rank makes every group)
    everywhere = torch.tensor([int(shm is not None)])
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if not everywhere.item():
        return DistCollectives()
    return HostGroups(shm, group, rank, per_host)


def host_segment(ranks_on_host: int, tag: str) -> str:
    """The shared segment of a host's ranks (its path), or NO_SEGMENT where they meet
    over gloo (one rank, or no compiled kernels)."""
    if ranks_on_host > 1 and shared_memory_usable():
        return create_segment(ranks_on_host, tag)
    return NO_SEGMENT


def shared_kv_prefix(config: EngineConfig, rendezvous: str) -> str | None:
    """Where the ranks of a disaggregated role keep their KV caches, so that rank 0
    moves every rank's blocks (runner/shared_kv.py): files in shared memory named
    after the group's rendezvous; None for a colocated engine (private memory)."""
    transfer = config.kv_transfer
    if transfer is None or transfer.role == "both":
        return None
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    digest = hashlib.sha256(rendezvous.encode()).hexdigest()[:16]
    return os.path.join(folder, f"tandem-kv-{digest}")


def send_config(config: EngineConfig) -> None:
    dist.broadcast_object_list([config], src=0)


def receive_config() -> EngineConfig:
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
