"""KV block transfer between instances, behind an interface shaped like NIXL's:

    agent = ZmqKVAgent(kv_cache)              register the cache's memory
    agent.metadata()                           what a peer needs to reach it (address)
    handle = agent.read_blocks(peer, pairs)    pull (remote block, local block) pairs, async
    handle.wait() / handle.done()              completion (raises on failure)
    agent.notify(peer, message)                a small message to the peer (lease release)

The default backend is ZeroMQ over TCP: each agent serves reads of its own blocks on
a ROUTER socket (port chosen automatically unless given) from a thread of its own, and
reads a peer's blocks over a DEALER socket per request. A read is one request (msgspec)
and one reply of two frames: a msgspec header (shape, dtype) and the blocks' bytes,
gathered into one contiguous buffer and sent without another copy. Whole blocks,
batched; no per-token messages.

The cache is ``[layers, 2, blocks, block_size, kv_heads, head_dim]``: a block's bytes
are strided across layers, so a read gathers ``cache[:, :, ids]`` and the receiver
scatters into ``cache[:, :, local_ids]``. Reads only ever touch blocks the serving side
holds under a lease (``authorize`` refuses any other read, and any read without the
lease's token), and writes only blocks the reading side allocated and has not handed
to anyone yet, so neither races with the engine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import zmq

from tandem.models.dtypes import DTYPES, torch_dtype_name


class ReadRequest(msgspec.Struct, tag=True):
    block_ids: list[int]
    lease_id: str = ""  # the lease the blocks are under, and its token (auth.py)
    token: str = ""


class Notify(msgspec.Struct, tag=True):
    message: dict


class MetadataRequest(msgspec.Struct, tag=True):
    """Ask a peer for what a one-sided backend (NIXL) needs to read its memory."""


class BlocksHeader(msgspec.Struct):
    shape: list[int]
    dtype: str
    error: str = ""


class KVTransferError(Exception):
    """A read failed: the peer is gone, refused, or had no such blocks."""


@dataclass
class TransferResult:
    num_blocks: int
    num_bytes: int
    seconds: float


class TensorKV:
    """One process's KV cache as the agents address it (a tensor-parallel instance's
    ranks give a RankedKVCache instead: runner/shared_kv.py)."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self.shape, self.dtype, self.device = tuple(cache.shape), cache.dtype, cache.device

    def read(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self.cache[:, :, block_ids]

    def write(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        self.cache[:, :, block_ids] = blocks


def kv_view(kv_cache):
    """A tensor wrapped as TensorKV; a view with ``read``/``write`` as it is."""
    return TensorKV(kv_cache) if isinstance(kv_cache, torch.Tensor) else kv_cache


class ZmqKVAgent:
    def __init__(
        self,
        kv_cache,
        host: str = "127.0.0.1",
        port: int = 0,
        on_notify: Callable[[dict], None] | None = None,
        timeout_s: float = 30.0,
        authorize: Callable[[str, str, list[int]], str] | None = None,
    ) -> None:
        """``kv_cache``: a tensor, or every rank's cache as one (RankedKVCache).
        ``authorize(lease_id, token, block_ids)``: why a read may not be served, or ""
        (None: serve every read; only for tests of the transport itself)."""
        self.kv_cache = kv_view(kv_cache)
        self.on_notify = on_notify
        self.authorize = authorize
        self.timeout_ms = int(timeout_s * 1000)
        self.context = zmq.Context.instance()
        self.server = self.context.socket(zmq.ROUTER)
        self.server.setsockopt(zmq.LINGER, 0)
        if port:
            self.server.bind(f"tcp://{host}:{port}")
        else:
            port = self.server.bind_to_random_port(f"tcp://{host}")
        self.host, self.port = host, port
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kv-read")
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-serve", daemon=True)
        self._thread.start()

    def metadata(self) -> dict:
        return {"host": self.host, "port": self.port}

    # -- serving reads of our blocks -----------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server, zmq.POLLIN)
        while not self._closed.is_set():
            if not poller.poll(100):
                continue
            identity, payload = self.server.recv_multipart()
            try:
                message = msgspec.msgpack.decode(
                    payload, type=ReadRequest | Notify | MetadataRequest
                )
            except msgspec.DecodeError as exc:
                header = BlocksHeader([], "", error=f"malformed request: {exc}")
                self.server.send_multipart([identity, msgspec.msgpack.encode(header), b""])
                continue
            if isinstance(message, Notify):
                if self.on_notify is not None:
                    self.on_notify(message.message)
                self.server.send_multipart([identity, b"ok"])
                continue
            if isinstance(message, MetadataRequest):
                self.server.send_multipart([identity, self.memory_metadata()])
                continue
            refusal = (
                self.authorize(message.lease_id, message.token, message.block_ids)
                if self.authorize is not None
                else ""
            )
            if refusal:
                header = BlocksHeader([], "", error=f"read refused: {refusal}")
                self.server.send_multipart([identity, msgspec.msgpack.encode(header), b""])
                continue
            try:
                ids = torch.tensor(message.block_ids, dtype=torch.long)
                blocks = self.kv_cache.read(ids.to(self.kv_cache.device)).contiguous().cpu()
                dtype = torch_dtype_name(blocks.dtype)
                header = BlocksHeader(list(blocks.shape), dtype)
                data = blocks.view(torch.uint8).numpy()
                self.server.send_multipart(
                    [identity, msgspec.msgpack.encode(header), memoryview(data)], copy=False
                )
            except (IndexError, RuntimeError) as exc:
                header = BlocksHeader([], "", error=f"cannot read blocks: {exc}")
                self.server.send_multipart([identity, msgspec.msgpack.encode(header), b""])

    def memory_metadata(self) -> bytes:
        """For one-sided backends: how a peer addresses our cache (none here)."""
        return b""

    # -- reading a peer's blocks ---------------------------------------------------------

    def read_blocks(
        self, peer: dict, pairs: list[tuple[int, int]]
    ) -> concurrent.futures.Future[TransferResult]:
        """Copy each remote block into the paired local block, in the background."""
        return self.pool.submit(self._read, peer, pairs)

    def _request(self, peer: dict, payload: bytes) -> list[bytes]:
        # ZeroMQ reconnects silently forever; a plain TCP connect first turns a refused
        # connection (the peer is gone) into an immediate error instead of a timeout.
        try:
            socket.create_connection((peer["host"], peer["port"]), timeout=5).close()
        except (OSError, KeyError, TypeError) as exc:
            raise KVTransferError(f"cannot connect to {peer}: {exc}") from exc
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        try:
            sock.connect(f"tcp://{peer['host']}:{peer['port']}")
            sock.send(payload)
            return sock.recv_multipart(copy=False)
        except zmq.Again as exc:
            raise KVTransferError(
                f"no answer from {peer['host']}:{peer['port']} within "
                f"{self.timeout_ms / 1000:.0f} s (is the prefill instance up?)"
            ) from exc
        finally:
            sock.close()

    def _read(self, peer: dict, pairs: list[tuple[int, int]]) -> TransferResult:
        started = time.perf_counter()
        remote = [r for r, _ in pairs]
        read = ReadRequest(remote, peer.get("lease_id") or "", peer.get("token") or "")
        frames = self._request(peer, msgspec.msgpack.encode(read))
        header = msgspec.msgpack.decode(frames[0].bytes, type=BlocksHeader)
        if header.error:
            raise KVTransferError(header.error)
        entry = DTYPES.get(header.dtype)  # a peer's word: unknown names do not fit
        dtype = entry.torch if entry is not None else None
        if dtype != self.kv_cache.dtype or header.shape[3:] != list(self.kv_cache.shape[3:]):
            raise KVTransferError(
                f"peer blocks {header.dtype} {header.shape} do not fit this cache "
                f"{self.kv_cache.dtype} {list(self.kv_cache.shape)}"
            )
        buffer = frames[1].buffer
        with warnings.catch_warnings():  # read-only frame: it is copied into the cache below
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(buffer, dtype=torch.uint8)
        blocks = raw.view(dtype).view(header.shape)
        local = torch.tensor([lo for _, lo in pairs], dtype=torch.long, device=self.kv_cache.device)
        self.kv_cache.write(local, blocks.to(self.kv_cache.device))
        return TransferResult(len(pairs), len(buffer), time.perf_counter() - started)

    def notify(self, peer: dict, message: dict) -> None:
        """Tell the peer something small (fire and forget; failures are ignored)."""

        def send() -> None:
            with contextlib.suppress(KVTransferError):
                self._request(peer, msgspec.msgpack.encode(Notify(message)))

        self.pool.submit(send)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server.close()
