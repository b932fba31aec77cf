"""``tandem serve``: claim the port, start the engine core (its own process, or a
thread with ``engine_process=False``), run uvicorn (with the header timeout of
limits.py). If the core process dies, the server fails what was in flight, answers
503 for a moment, then exits with status 1."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import uvicorn

from tandem.config import EngineConfig
from tandem.errors import TandemError
from tandem.server.api import build_app
from tandem.server.limits import ServerLimits, h11_protocol
from tandem.serving.data_parallel import check_data_parallel, start_engine
from tandem.serving.engine_client import EngineClient
from tandem.serving.served_engine import CoreOptions, ServedEngine

logger = logging.getLogger("tandem.server")

# After the core died: seconds left to send the error frames (and 503s) before exiting.
EXIT_GRACE_S = 1.0


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
    engine_process: bool = True,
    threads: int = 0,
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
    data_parallel_size: int = 1,
    data_parallel_routing: str = "least-busy",
) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    limits = limits or ServerLimits()
    listener = claim_port(host, port)  # a busy port fails now, not after loading the model
    config = EngineConfig.from_kwargs(model, **engine_options)
    check_data_parallel(config, data_parallel_size, engine_process, data_parallel_routing)
    name = served_model_name or Path(model).name
    options = CoreOptions(name, max_waiting_requests, trace, host, log_level, threads)
    server: uvicorn.Server | None = None
    died = threading.Event()

    def on_dead(_: str) -> None:
        died.set()

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        threading.Timer(EXIT_GRACE_S, stop).start()

    if engine_process:
        client: EngineClient = start_engine(
            config, options, data_parallel_size, on_dead, data_parallel_routing
        )
    else:
        client = _in_process_engine(config, options)
    app = build_app(
        client, name, api_key, client.shutdown, limits, enable_trace_endpoints, tool_call_parser,
        reasoning_parser,
    )  # fmt: skip
    info = client.info
    logger.info(
        "serving %s as %r on http://%s:%d (%d KV blocks of %d tokens, max_model_len %d, "
        "%s)",
        model, name, host, port, info.num_blocks, info.block_size, info.max_model_len,
        f"{data_parallel_size} engine cores, each in its own process" if data_parallel_size > 1
        else "engine core in its own process" if engine_process
        else "engine core on a thread of this process",
    )  # fmt: skip
    server = make_server(app, log_level, limits.header_timeout)
    server.run(sockets=[listener])
    if died.is_set():
        raise SystemExit(f"tandem serve: {client.dead_reason}")


def _in_process_engine(config: EngineConfig, options: CoreOptions) -> EngineClient:
    """The core on a thread of this process (``--no-engine-process``)."""
    from tandem.serving.async_engine import AsyncEngine

    served = ServedEngine(config, options)
    client = AsyncEngine(
        served.engine, options.max_waiting_requests, served.metrics, on_shutdown=served.close
    )
    served.connect(client.core)
    return client


def make_server(app, log_level: str, header_timeout: float) -> uvicorn.Server:
    """uvicorn for a claimed port, closing connections whose headers are too slow."""
    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, http=h11_protocol(header_timeout)
    )
    return uvicorn.Server(config)


def run_app(app, listener: socket.socket, log_level: str, header_timeout: float) -> None:
    make_server(app, log_level, header_timeout).run(sockets=[listener])


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
