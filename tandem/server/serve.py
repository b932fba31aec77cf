"""``tandem serve``: claim the port, load the model, start the engine thread, run
uvicorn (with the header timeout of limits.py)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import uvicorn

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.errors import TandemError
from tandem.server.api import build_app
from tandem.server.async_engine import AsyncEngine
from tandem.server.limits import ServerLimits, h11_protocol
from tandem.server.metrics import ServerMetrics

logger = logging.getLogger("tandem.server")


def run_server(
    model: str,
    engine_options: dict,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_waiting_requests: int | None = None,
    log_level: str = "info",
    trace: str | None = None,
    limits: ServerLimits | None = None,
    enable_trace_endpoints: bool = False,
) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    limits = limits or ServerLimits()
    listener = claim_port(host, port)  # a busy port fails now, not after loading the model
    config = EngineConfig.from_kwargs(model, **engine_options)
    engine = Engine(config)
    name = served_model_name or Path(model).name
    metrics = ServerMetrics(name, engine.max_model_len)
    if trace is not None:
        engine.start_trace()
    async_engine = AsyncEngine(engine, max_waiting_requests, metrics)
    engine.notify_changed()  # the gauges start from the idle engine
    connector = None
    if config.kv_transfer is not None and config.kv_transfer.role != "both":
        from tandem.disagg.connector import DisaggConnector

        connector = DisaggConnector(async_engine, metrics, config.kv_transfer, host)

    def shutdown() -> None:
        async_engine.shutdown()
        if connector is not None:
            connector.close()
        if trace is not None and engine.tracer is not None:
            engine.stop_trace(trace)
            logger.info("trace written to %s", trace)

    app = build_app(async_engine, metrics, name, api_key, shutdown, limits, enable_trace_endpoints)
    logger.info(
        "serving %s as %r on http://%s:%d (%d KV blocks of %d tokens, max_model_len %d)",
        model, name, host, port, engine.kv_manager.num_blocks,
        engine.kv_manager.block_size, engine.max_model_len,
    )  # fmt: skip
    run_app(app, listener, log_level, limits.header_timeout)


def run_app(app, listener: socket.socket, log_level: str, header_timeout: float) -> None:
    """uvicorn on a claimed port, closing connections whose headers are too slow."""
    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, http=h11_protocol(header_timeout)
    )
    uvicorn.Server(config).run(sockets=[listener])


def claim_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it), or a one-line error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as exc:
        raise TandemError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    listener.set_inheritable(True)
    return listener
