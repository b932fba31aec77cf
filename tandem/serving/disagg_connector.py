"""DisaggConnector: the KV connector (engine/kv_connector.py) of a `tandem serve
--role prefill|decode` instance.

    prefill role   a request with kv_transfer_params {"do_remote_decode": true} runs its
                   prompt (max_tokens 1); when it finishes, the connector keeps its blocks
                   under a lease and its output carries {lease_id, remote_block_ids,
                   remote_num_tokens, remote_host, remote_port, remote_engine_id}. The
                   lease ends when the decode side says it has read the blocks, or when
                   it expires (a decode side that never comes back leaks nothing).
    decode role    a request carrying those parameters gets blocks for the first
                   remote_num_tokens prompt tokens (the scheduler allocates them and
                   parks the request), the agent pulls them in the background, then the
                   request runs from there: only its last prompt token is computed here.
                   If the pull fails, it recomputes the prompt, or fails with a clear
                   error (``on_failure``).

Trust (auth.py, docs/SECURITY.md): the parameters a prefill instance returns are
signed with the deployment's secret and bound to the prompt's tokens and cache_salt;
a decode instance queues a request that names remote blocks only if they verify
(``check``), and every read or release presents the lease's token. A prefill
instance keeps at most ``max_leased_fraction`` of its cache under leases.

Every engine-state change happens on the core thread (EngineCore.submit): the
scheduler's hooks run there, and the agent's threads hand their results over through
it; the agent only moves bytes between leased or freshly allocated blocks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from tandem.config import KVTransferConfig
from tandem.disagg.agents import make_kv_agent
from tandem.disagg.auth import KVAuth, prompt_digest
from tandem.disagg.transfer import KVTransferError
from tandem.engine.core import EngineCore
from tandem.engine.input_processor import EngineRequest
from tandem.engine.kv_connector import FinishedTransfer
from tandem.engine.request import Request, keeps_for_decode, remote_prefix
from tandem.errors import InvalidParameterError, TandemError
from tandem.serving.metrics import ServerMetrics

logger = logging.getLogger("tandem.disagg")


class DisaggConnector:
    def __init__(
        self,
        core: EngineCore,
        metrics: ServerMetrics,
        config: KVTransferConfig,
        host: str = "127.0.0.1",
        transfer_timeout_s: float = 30.0,
    ) -> None:
        self.core = core
        self.engine = engine = core.engine
        self.metrics = metrics
        self.config = config
        self.engine_id = uuid.uuid4().hex[:12]
        self.auth = KVAuth.from_config(config.secret)
        self.agent = make_kv_agent(
            engine.executor.kv_cache, host, config.kv_port, self._on_notify, transfer_timeout_s,
            config.backend, self._authorize_read,
        )  # fmt: skip
        # Prefill side: lease id -> (blocks, deadline); decode side: finished pulls not
        # yet taken by the scheduler.
        self.leases: dict[str, tuple[list[int], float]] = {}
        self.num_lease_expiries = 0
        self._finished: list[FinishedTransfer] = []
        engine.set_kv_connector(self)
        self._stop = threading.Event()
        self._expiry = threading.Thread(target=self._expire_loop, name="kv-leases", daemon=True)
        self._expiry.start()
        logger.info(
            "%s role: KV transfer (%s) on %s:%d (engine %s)", config.role,
            type(self.agent).__name__, self.agent.host, self.agent.port, self.engine_id,
        )  # fmt: skip

    @property
    def num_leases(self) -> int:
        return len(self.leases)

    # -- before queuing (any thread) ---------------------------------------------------

    def check(self, request: EngineRequest) -> None:
        transfer = request.kv_transfer
        if transfer is None or not transfer.pulls:
            return
        if self.config.role != "decode":
            raise InvalidParameterError(
                "kv_transfer_params", "only a decode instance reads remote blocks"
            )
        if not self.auth.verify({**transfer.signed_fields(), "signature": transfer.signature}):
            raise InvalidParameterError(
                "kv_transfer_params", "are not signed by a prefill instance of this deployment"
            )
        covered = request.prompt_token_ids[: transfer.remote_num_tokens]
        if transfer.prompt_digest != prompt_digest(covered, request.cache_salt):
            raise InvalidParameterError(
                "kv_transfer_params", "belong to another prompt (or another cache_salt)"
            )

    # -- the scheduler's hooks (engine thread) ----------------------------------------

    def num_remote_tokens(self, request: Request) -> int:
        transfer = request.kv_transfer
        return transfer.remote_num_tokens if transfer is not None else 0

    def on_blocks_allocated(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        """Start reading the remote blocks into ours, in the background."""
        transfer = request.kv_transfer
        pairs = list(zip(transfer.remote_block_ids, block_ids, strict=False))
        lease_id = transfer.lease_id
        peer = {"host": transfer.remote_host, "port": transfer.remote_port,
                "lease_id": lease_id, "token": self.auth.lease_token(lease_id or "")}  # fmt: skip
        future = self.agent.read_blocks(peer, pairs)
        request_id = request.request_id

        def done(_) -> None:  # (agent thread) hand the outcome to the engine thread
            self.core.submit(lambda: self._pulled(request_id, future, peer, lease_id))

        future.add_done_callback(done)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: keep a finished prompt's blocks under a lease for the decode
        instance, and say where they are."""
        if not keeps_for_decode(request):
            return False, None
        leased = sum(len(blocks) for blocks, _ in self.leases.values())
        limit = self.config.max_leased_fraction * self.engine.kv_manager.num_blocks
        if leased + len(block_ids) > limit:
            logger.warning(
                "request %s: not keeping its %d blocks for a decode side (%d of %d blocks "
                "already leased; --kv-max-leased-fraction %.2f)", request.request_id,
                len(block_ids), leased, self.engine.kv_manager.num_blocks,
                self.config.max_leased_fraction,
            )  # fmt: skip
            return False, None
        deadline = time.monotonic() + self.config.lease_seconds
        self.leases[request.request_id] = (block_ids, deadline)
        num_tokens, remote_blocks = remote_prefix(
            request, block_ids, self.engine.kv_manager.block_size
        )
        params = {
            "lease_id": request.request_id,
            "remote_block_ids": remote_blocks,
            "remote_num_tokens": num_tokens,
            "remote_host": self.agent.host,
            "remote_port": self.agent.port,
            "remote_engine_id": self.engine_id,
            "prompt_digest": prompt_digest(
                request.prompt_token_ids[:num_tokens], request.cache_salt
            ),
        }
        params["signature"] = self.auth.sign(params)
        return True, params

    def finished_transfers(self) -> list[FinishedTransfer]:
        finished, self._finished = self._finished, []
        return finished

    # -- prefill side --------------------------------------------------------------------

    def _on_notify(self, message: dict) -> None:
        """(Agent thread) the decode side read a lease's blocks, or gave up on them
        (a release without the lease's token is ignored)."""
        lease_id = message.get("release")
        if self.auth.check_lease_token(lease_id, message.get("token")):
            self.core.submit(lambda: self._release(lease_id))

    def _authorize_read(self, lease_id: object, token: object, block_ids: list[int]) -> str:
        """(Agent thread) why a read may not be served, or "" when it may: it must name
        a live lease with its token, and only blocks of that lease. (The leases dict
        is the engine thread's; a lookup is atomic, and a lease released between this
        check and the copy only means the reader came after its deadline.)"""
        if not self.auth.check_lease_token(lease_id, token):
            return "not authorized (a lease id and its token are required)"
        lease = self.leases.get(lease_id)
        if lease is None:
            return f"no live lease {lease_id!r} (expired or released)"
        if not set(block_ids) <= set(lease[0]):
            return "the blocks asked for are not the lease's"
        return ""

    def _release(self, lease_id: str) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.engine.kv_manager.release_detached(lease[0])
            self.engine.notify_changed()

    def _expire_loop(self) -> None:
        while not self._stop.wait(0.5):
            if self.leases:
                self.core.submit(self._expire)

    def _expire(self) -> None:
        now = time.monotonic()
        expired = [lease_id for lease_id, (_, deadline) in self.leases.items() if deadline < now]
        self.num_lease_expiries += len(expired)  # counted before the release notifies
        for lease_id in expired:
            self._release(lease_id)
        if expired:
            logger.warning("%d KV lease(s) expired unread; their blocks are free", len(expired))

    # -- decode side ---------------------------------------------------------------------

    def _pulled(self, request_id: str, future, peer: dict, lease_id: str | None) -> None:
        """(Engine thread) a pull ended: record it, let the scheduler take it."""
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
        if lease_id is not None and peer.get("host"):  # read or not, the lease can go
            self.agent.notify(peer, {"release": lease_id, "token": peer["token"]})
        recompute = self.config.on_failure == "recompute"
        self._finished.append(FinishedTransfer(request_id, error is None, recompute))
        for failed_id in self.engine.poll_kv_transfers():
            self.core.fail(
                failed_id,
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
