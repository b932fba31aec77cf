"""Which KV transfer agent an instance gets: NIXL's where installed (or asked for),
ZeroMQ's otherwise (transfer.py, nixl_transfer.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.disagg.transfer import KVTransferError, ZmqKVAgent


def make_kv_agent(
    kv_cache,
    host: str = "127.0.0.1",
    port: int = 0,
    on_notify: Callable[[dict], None] | None = None,
    timeout_s: float = 30.0,
    backend: str = "auto",
    authorize: Callable[[str, str, list[int]], str] | None = None,
) -> ZmqKVAgent:
    """The NIXL backend when ``nixl`` is installed (``auto``) or asked for, else ZeroMQ
    (always for a tensor-parallel instance's ranks: NIXL registers one tensor)."""
    if not isinstance(kv_cache, torch.Tensor):
        if backend == "nixl":
            raise KVTransferError("--kv-backend nixl registers one tensor: use zmq with "
                                  "--tensor-parallel-size or a model whose layers' K/V "
                                  "differ in shape (Gemma 4)")  # fmt: skip
        backend = "zmq"
    if backend in ("auto", "nixl"):
        try:
            from tandem.disagg.nixl_transfer import NixlKVAgent
        except ImportError:
            if backend == "nixl":
                raise KVTransferError("--kv-backend nixl needs the nixl package") from None
        else:
            return NixlKVAgent(kv_cache, host, port, on_notify, timeout_s, authorize)
    return ZmqKVAgent(kv_cache, host, port, on_notify, timeout_s, authorize)
