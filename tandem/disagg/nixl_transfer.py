"""The NIXL backend: blocks read one-sided (RDMA where the NICs allow, UCX otherwise)
straight from the peer's registered cache into ours. The ZeroMQ channel of the base
agent stays for the rest: exchanging NIXL metadata once per peer, and notifications.

A block is not contiguous in the cache ``[layers, 2, blocks, block_size, heads, dim]``:
it is ``2 x layers`` regions, one per layer and K/V, each contiguous; a read lists them
all for every (remote, local) pair and NIXL moves them in one transfer.
"""

from __future__ import annotations

import time
import uuid

import msgspec
import torch
from nixl._api import nixl_agent, nixl_agent_config

from tandem.disagg.transfer import (
    KVTransferError,
    MetadataRequest,
    TransferResult,
    ZmqKVAgent,
)


class _Layout(msgspec.Struct):
    agent: bytes
    base: int  # address of the cache's first element
    strides: list[int]  # in elements
    element_size: int
    shape: list[int]
    dtype: str
    device: int


class NixlKVAgent(ZmqKVAgent):
    def __init__(self, kv_cache: torch.Tensor, *args, **kwargs) -> None:
        self.nixl = nixl_agent(f"tandem-{uuid.uuid4().hex[:12]}", nixl_agent_config(
            backends=["UCX"]))  # fmt: skip
        self.memory_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.nixl.register_memory([kv_cache])
        self.tensor = kv_cache  # (self.kv_cache: the TensorKV the ZeroMQ path reads)
        self.peers: dict[tuple[str, int], tuple[str, _Layout]] = {}
        super().__init__(kv_cache, *args, **kwargs)

    def memory_metadata(self) -> bytes:
        cache = self.tensor
        return msgspec.msgpack.encode(
            _Layout(
                self.nixl.get_agent_metadata(), cache.data_ptr(), list(cache.stride()),
                cache.element_size(), list(cache.shape), str(cache.dtype),
                cache.device.index or 0,
            )
        )  # fmt: skip

    def _peer(self, peer: dict) -> tuple[str, _Layout]:
        key = (peer["host"], peer["port"])
        if key not in self.peers:
            reply = self._request(peer, msgspec.msgpack.encode(MetadataRequest()))
            layout = msgspec.msgpack.decode(reply[0].bytes, type=_Layout)
            if layout.dtype != str(self.kv_cache.dtype) or layout.shape[3:] != list(
                self.kv_cache.shape[3:]
            ):
                raise KVTransferError(f"peer cache {layout.dtype} {layout.shape} does not fit")
            self.peers[key] = (self.nixl.add_remote_agent(layout.agent), layout)
        return self.peers[key]

    @staticmethod
    def _regions(base: int, strides: list[int], size: int, layers: int, blocks, device: int):
        block_bytes = strides[2] * size
        return [
            (base + (layer * strides[0] + kv * strides[1] + block * strides[2]) * size,
             block_bytes, device)
            for layer in range(layers) for kv in range(2) for block in blocks
        ]  # fmt: skip

    def _read(self, peer: dict, pairs: list[tuple[int, int]]) -> TransferResult:
        started = time.perf_counter()
        name, remote = self._peer(peer)
        cache = self.tensor
        layers = cache.shape[0]
        local_descs = self.nixl.get_xfer_descs(
            self._regions(cache.data_ptr(), list(cache.stride()), cache.element_size(), layers,
                          [lo for _, lo in pairs], cache.device.index or 0),
            self.memory_type,
        )  # fmt: skip
        remote_descs = self.nixl.get_xfer_descs(
            self._regions(remote.base, remote.strides, remote.element_size, layers,
                          [r for r, _ in pairs], remote.device),
            self.memory_type,
        )  # fmt: skip
        handle = self.nixl.initialize_xfer("READ", local_descs, remote_descs, name)
        try:
            state = self.nixl.transfer(handle)
            deadline = time.monotonic() + self.timeout_ms / 1000
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)
                state = self.nixl.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(f"NIXL read from {peer} ended in state {state}")
        finally:
            self.nixl.release_xfer_handle(handle)
        num_bytes = len(pairs) * 2 * layers * cache.stride()[2] * cache.element_size()
        return TransferResult(len(pairs), num_bytes, time.perf_counter() - started)
