"""The KV-connector seam: how a request's K/V arrive from, or are kept for, another
engine instance (disaggregated prefill/decode), in the shape of vLLM's
KVConnectorBase_V1 scheduler side. The scheduler calls four hooks; an implementation
(tandem/serving/disagg_connector.py) moves the bytes on its own threads and owns the blocks it
keeps. Nothing about leases, hosts or transfers lives in the scheduler, the KV manager
or the request::

    add_request ──num_remote_tokens(r) > 0──> allocate blocks for them,
                                              on_blocks_allocated(r, blocks, n),
                                              r waits as WAITING_FOR_REMOTE_KV
    poll_transfers <──finished_transfers()──  (id, ok, recompute): ok -> r runs from n;
                                              failed -> recompute here, or r fails
    _finish(r) ──request_finished(r, blocks)─> (keep, params): keep -> the connector
                                              owns the blocks (KVCacheManager.detach)
                                              until it releases them; params go into
                                              r's output for the other side

Contract: a request aborted while its blocks are being written keeps them until
``finished_transfers`` names it (the writer must not write into freed blocks). A
request's parameters pass ``check`` before it is queued: a client's word is never
taken for which blocks to read, or from where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tandem.engine.input_processor import EngineRequest
    from tandem.engine.request import Request


@dataclass(frozen=True)
class FinishedTransfer:
    request_id: str
    ok: bool
    recompute: bool = True  # on failure: compute the prompt here (else the request fails)


class KVConnector(Protocol):
    """Scheduler-side hooks. Called on the engine's thread only."""

    num_leases: int  # requests whose blocks the connector holds for another instance
    num_lease_expiries: int  # ... released because nobody came for them

    def check(self, request: EngineRequest) -> None:
        """Raise InvalidParameterError for transfer parameters this connector will not
        act on (forged, or not this prompt's); called before the request is queued,
        on any thread (it reads only immutable state)."""
        ...

    def num_remote_tokens(self, request: Request) -> int:
        """Prompt tokens whose K/V this request will receive instead of computing."""
        ...

    def on_blocks_allocated(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        """Blocks for the first ``num_tokens`` tokens are allocated: start receiving."""
        ...

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request ended (its status says how). Returns whether the connector keeps
        its blocks (it then releases them itself) and the parameters its output
        carries for the other instance."""
        ...

    def finished_transfers(self) -> list[FinishedTransfer]:
        """Receives that ended since the last call."""
        ...
