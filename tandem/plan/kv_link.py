"""The KV-connector seam (tandem/engine/kv_connector.py) for simulated instances: the
real scheduler keeps and receives prompts' blocks exactly as it does when serving
disaggregated, while the bytes "move" on simulated time (tandem/plan/simulate.py
schedules each pull's end from the link's cost).

Prefill side: a finished prompt whose request asked ``do_remote_decode`` keeps its
blocks under a lease (at most ``max_leased_fraction`` of the cache, as the real
connector) and its output names them. Decode side: a request carrying those
parameters has blocks allocated for the remote tokens; ``on_pull`` tells the
simulation, which later calls ``pulled``; the scheduler then runs it from there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.config import KVTransferConfig
from tandem.engine.kv_connector import FinishedTransfer
from tandem.engine.request import Request, keeps_for_decode, remote_prefix


class SimulatedConnector:
    num_lease_expiries = 0  # leases end when their pull ends (none waits for a timeout)

    def __init__(
        self,
        name: str,
        num_blocks: int,
        block_size: int,
        on_pull: Callable[[Request, int], None],
        max_leased_fraction: float = KVTransferConfig.max_leased_fraction,
    ) -> None:
        self.name, self.num_blocks, self.block_size = name, num_blocks, block_size
        self.on_pull = on_pull
        self.max_leased_fraction = max_leased_fraction
        self.leases: dict[str, list[int]] = {}
        self._finished: list[FinishedTransfer] = []

    @property
    def num_leases(self) -> int:
        return len(self.leases)

    def check(self, request) -> None:  # the simulation writes every parameter itself
        pass

    def num_remote_tokens(self, request: Request) -> int:
        return request.kv_transfer.remote_num_tokens if request.kv_transfer else 0

    def on_blocks_allocated(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        self.on_pull(request, num_tokens)

    def pulled(self, request_id: str) -> None:
        """The simulated transfer of ``request_id``'s K/V into this instance ended."""
        self._finished.append(FinishedTransfer(request_id, ok=True))

    def finished_transfers(self) -> list[FinishedTransfer]:
        finished, self._finished = self._finished, []
        return finished

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not keeps_for_decode(request):
            return False, None
        leased = sum(len(blocks) for blocks in self.leases.values())
        if leased + len(block_ids) > self.max_leased_fraction * self.num_blocks:
            return False, None  # the decode side computes the prompt
        self.leases[request.request_id] = block_ids
        num_tokens, remote_blocks = remote_prefix(request, block_ids, self.block_size)
        return True, {
            "lease_id": request.request_id,
            "remote_block_ids": remote_blocks,
            "remote_num_tokens": num_tokens,
            "remote_engine_id": self.name,
        }

    def release(self, lease_id: str, kv_manager) -> None:
        """The decode side has read the lease's blocks (or will not)."""
        blocks = self.leases.pop(lease_id, None)
        if blocks is not None:
            kv_manager.release_detached(blocks)
