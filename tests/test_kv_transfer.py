"""The KV transfer backend on its own: blocks arrive bit-exact, failures are errors."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.disagg.agents import make_kv_agent
from tandem.disagg.transfer import KVTransferError, ZmqKVAgent


def backend_or_skip(backend: str) -> str:
    if backend == "nixl":
        pytest.importorskip("nixl", reason="the NIXL backend needs the nixl package")
    return backend


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_blocks_arrive_bit_exact(dtype, backend):
    backend_or_skip(backend)
    shape = (3, 2, 12, 4, 2, 8)  # layers, K/V, blocks, block size, KV heads, head dim
    source = torch.randn(shape).to(dtype)
    target = torch.zeros(shape, dtype=dtype)
    notes = []
    serving = make_kv_agent(source, on_notify=notes.append, backend=backend)
    reading = make_kv_agent(target, backend=backend)
    assert type(reading).__name__ == {"zmq": "ZmqKVAgent", "nixl": "NixlKVAgent"}[backend]
    try:
        pairs = [(7, 0), (2, 5), (11, 9)]
        result = reading.read_blocks(serving.metadata(), pairs).result(timeout=30)
        assert result.num_blocks == 3
        assert result.num_bytes == 3 * source[:, :, 0].numel() * source.element_size()
        for remote, local in pairs:
            assert torch.equal(target[:, :, local].view(torch.uint8),
                               source[:, :, remote].view(torch.uint8))  # fmt: skip
        untouched = [b for b in range(12) if b not in (0, 5, 9)]
        assert not target[:, :, untouched].any()
        reading.notify(serving.metadata(), {"release": "lease-1"})
        deadline = time.monotonic() + 10
        while not notes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert notes == [{"release": "lease-1"}]
    finally:
        serving.close()
        reading.close()


def test_a_gone_peer_or_bad_blocks_are_errors():
    reading = ZmqKVAgent(torch.zeros(1, 2, 4, 2, 1, 4), timeout_s=0.5)
    serving = ZmqKVAgent(torch.zeros(1, 2, 4, 2, 1, 4))
    try:
        with pytest.raises(KVTransferError, match="cannot connect"):
            reading.read_blocks({"host": "127.0.0.1", "port": 9}, [(0, 0)]).result(timeout=10)
        with pytest.raises(KVTransferError, match="cannot read blocks"):
            reading.read_blocks(serving.metadata(), [(99, 0)]).result(timeout=10)
    finally:
        reading.close()
        serving.close()
