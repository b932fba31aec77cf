"""uvicorn on a thread of the test process, for tests that must reach inside a server
(fault injection). Real server processes come from tandem.server.launch."""

from __future__ import annotations

import contextlib
import threading

import uvicorn

from tandem.server.launch import free_port, wait_healthy


@contextlib.contextmanager
def thread_server(app):
    """Serve a FastAPI app with uvicorn on a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
