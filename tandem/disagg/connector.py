"""KVConnector: one server's side of disaggregated prefill/decode.

    prefill role   a request with kv_transfer_params {"do_remote_decode": true} runs its
                   prompt (max_tokens 1); when it finishes, its blocks stay under a lease
                   and the response carries {lease_id, remote_block_ids,
                   remote_num_tokens, remote_host, remote_port, remote_engine_id}. The
                   lease ends when the decode side says it has read the blocks, or when
                   it expires (a decode side that never comes back leaks nothing).
    decode role    a request carrying those parameters gets blocks for the first
                   remote_num_tokens prompt tokens, pulls them (KV agent, in the
                   background), then runs from there: it recomputes only the last prompt
                   token. If the pull fails, it recomputes the prompt, or fails with a
                   clear error (``on_failure``).

Every engine-state change happens on the engine thread (AsyncEngine.submit); the agent's
threads only move bytes between leased or freshly allocated blocks.
"""

from __future__ import annotations

import logging
import threading
import uuid

from tandem.disagg.transfer import KVTransferError, make_kv_agent
from tandem.engine.input_processor import KVTransferParams
from tandem.errors import TandemError
from tandem.server.async_engine import AsyncEngine
from tandem.server.metrics import ServerMetrics

logger = logging.getLogger("tandem.disagg")

ROLES = ("prefill", "decode", "both")


class KVConnector:
    def __init__(
        self,
        async_engine: AsyncEngine,
        metrics: ServerMetrics,
        role: str,
        kv_port: int = 0,
        host: str = "127.0.0.1",
        lease_seconds: float = 30.0,
        on_failure: str = "recompute",
        transfer_timeout_s: float = 30.0,
        backend: str = "auto",
    ) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.metrics = metrics
        self.role = role
        self.on_failure = on_failure
        self.engine_id = uuid.uuid4().hex[:12]
        self.engine.kv_lease_seconds = lease_seconds
        self.agent = make_kv_agent(
            self.engine.runner.kv_cache, host, kv_port, self._on_notify, transfer_timeout_s,
            backend,
        )  # fmt: skip
        async_engine.connector = self
        self._stop = threading.Event()
        self._expiry = threading.Thread(target=self._expire_loop, name="kv-leases", daemon=True)
        self._expiry.start()
        logger.info(
            "%s role: KV transfer (%s) on %s:%d (engine %s)", role,
            type(self.agent).__name__, self.agent.host, self.agent.port, self.engine_id,
        )  # fmt: skip

    def address(self) -> dict:
        """What the prefill side adds to its answer: where to read the blocks."""
        return {
            "remote_host": self.agent.host,
            "remote_port": self.agent.port,
            "remote_engine_id": self.engine_id,
        }

    # -- prefill side --------------------------------------------------------------------

    def _on_notify(self, message: dict) -> None:
        """(Agent thread) the decode side read a lease's blocks, or gave up on them."""
        lease_id = message.get("release")
        if isinstance(lease_id, str):
            self.async_engine.submit(lambda: self._release(lease_id))

    def _release(self, lease_id: str) -> None:
        self.engine.kv_manager.release_lease(lease_id)
        self.engine.notify_changed()

    def _expire_loop(self) -> None:
        while not self._stop.wait(0.5):
            if self.engine.kv_manager.leases:
                self.async_engine.submit(self._expire)

    def _expire(self) -> None:
        expired = self.engine.kv_manager.expire_leases()
        if expired:
            logger.warning("%d KV lease(s) expired unread; their blocks are free", expired)
            self.engine.notify_changed()

    # -- decode side ---------------------------------------------------------------------

    def pull(self, request_id: str, params: KVTransferParams) -> None:
        """(Engine thread) start reading a parked request's blocks from the prefill side."""
        _, pairs, _ = self.engine.pending_kv[request_id]
        peer = {"host": params.remote_host, "port": params.remote_port}
        lease_id = params.lease_id
        future = self.agent.read_blocks(peer, pairs)

        def done(_) -> None:  # (agent thread) hand the outcome to the engine thread
            self.async_engine.submit(lambda: self._pulled(request_id, future, peer, lease_id))

        future.add_done_callback(done)

    def _pulled(self, request_id: str, future, peer: dict, lease_id: str | None) -> None:
        error = future.exception()
        if error is None:
            result = future.result()
            self.metrics.transfer_done(result.num_blocks, result.num_bytes, result.seconds)
            logger.info(
                "request %s: pulled %d blocks (%.1f kB) in %.1f ms, %.2f GB/s", request_id,
                result.num_blocks, result.num_bytes / 1e3, result.seconds * 1e3,
                result.num_bytes / max(result.seconds, 1e-9) / 1e9,
            )  # fmt: skip
        else:
            self.metrics.transfer_failed()
            logger.warning("request %s: KV pull failed: %s", request_id, error)
        if lease_id is not None and peer.get("host"):
            self.agent.notify(peer, {"release": lease_id})  # read or not, the lease can go
        recompute = self.on_failure == "recompute"
        kept = self.engine.finish_remote_kv(request_id, error is None, recompute)
        if error is not None and not kept:
            self.async_engine.fail(
                request_id,
                TandemError(
                    f"could not read the prompt's KV from the prefill instance: {error}"
                    if isinstance(error, KVTransferError)
                    else f"KV transfer failed: {error}"
                ),
            )
        self.engine.notify_changed()

    def close(self) -> None:
        self._stop.set()
        self.agent.close()
