"""``tandem serve``: load the model, start the engine thread, run uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.server.api import build_app
from tandem.server.async_engine import AsyncEngine
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
    role: str = "both",
    kv_port: int = 0,
    kv_lease_seconds: float = 30.0,
    kv_transfer_failure: str = "recompute",
    kv_backend: str = "auto",
) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    engine = Engine(EngineConfig.from_kwargs(model, **engine_options))
    name = served_model_name or Path(model).name
    metrics = ServerMetrics(name)
    if trace is not None:
        engine.start_trace()
    async_engine = AsyncEngine(engine, max_waiting_requests, metrics)
    engine.notify_changed()  # the gauges start from the idle engine
    connector = None
    if role != "both":
        from tandem.disagg.connector import KVConnector

        connector = KVConnector(
            async_engine, metrics, role, kv_port, host, kv_lease_seconds, kv_transfer_failure,
            backend=kv_backend,
        )  # fmt: skip

    def shutdown() -> None:
        async_engine.shutdown()
        if connector is not None:
            connector.close()
        if trace is not None and engine.tracer is not None:
            engine.stop_trace(trace)
            logger.info("trace written to %s", trace)

    app = build_app(async_engine, metrics, name, api_key, on_shutdown=shutdown)
    logger.info(
        "serving %s as %r on http://%s:%d (%d KV blocks of %d tokens, max_model_len %d)",
        model, name, host, port, engine.kv_manager.num_blocks,
        engine.kv_manager.block_size, engine.max_model_len,
    )  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
