"""Collectives of tensor-parallel ranks on several hosts with several ranks on each.

The ranks of a host meet in their host's shared segment (runner/shm_group.py); the
hosts meet over gloo, each through its first rank (the leaders' group). Rank r is
on host r // L (L ranks a host), so a host's ranks hold adjacent shards.

    all_reduce   the host's sum in shared memory; the leaders all-reduce their
                 hosts' sums over gloo; every rank of a host then takes its leader's
                 total through shared memory again, the others adding zeros (exact:
                 x + 0 is x), so every rank of every host ends with the same bits
    all_gather   the host's columns in shared memory; the leaders all-gather their
                 hosts' blocks over gloo; the host's ranks take the leader's whole
                 row the same way

Over gloo alone, every one of a step's collectives crosses loopback or the network
between every pair of ranks; here only one rank a host does, once.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tandem.runner.shm_group import ShmGroup
from tandem.runner.tensor_parallel import DistCollectives


class HostGroups:
    def __init__(
        self, host: ShmGroup, leaders: dist.ProcessGroup, rank: int, ranks_per_host: int
    ) -> None:
        self.host, self.leaders = host, leaders
        self.per_host = ranks_per_host
        self.host_index = rank // ranks_per_host
        self.lead = rank % ranks_per_host == 0
        self.between_hosts = DistCollectives(leaders)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        if self.lead:
            self.between_hosts.set_timeout(timeout)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.host.all_reduce(tensor)
        if self.lead:
            dist.all_reduce(tensor, group=self.leaders)
        else:
            tensor.zero_()
        self.host.all_reduce(tensor)

    def all_gather(self, local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        per = self.per_host
        hosts = [sizes[h * per : (h + 1) * per] for h in range(len(sizes) // per)]
        mine = self.host.all_gather(local, hosts[self.host_index])
        if self.lead:
            whole = self.between_hosts.all_gather(mine, [sum(h) for h in hosts])
        else:
            whole = mine.new_zeros(mine.shape[0], sum(sizes))
        self.host.all_reduce(whole)
        return whole
