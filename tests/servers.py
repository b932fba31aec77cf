"""Helpers for tests of running servers: `tandem serve` of a test model as a real
process (and the flags of a disaggregated role), uvicorn on a thread of the test
process (for tests that must reach inside a server), reading /metrics, waiting for a
condition, finding a server's engine-core and rank processes."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tandem.server.launch import free_port, tandem_process, wait_healthy
from tandem.serving.metrics import RENDER_INTERVAL

MODEL = "tiny"  # the name servers of the test model folders are served as
KV_SECRET = "test-deployment-secret"  # of the disaggregated test deployments


def serve(folder: str, *flags: str):
    """`tandem serve` of a test model folder (a real process), served as MODEL."""
    return tandem_process(*served(folder, *flags))


def served(folder: str, *flags: str) -> tuple[str, ...]:
    """``serve``'s command, for several started together (``tandem_servers``)."""
    return ("serve", "--model", folder, "--served-model-name", MODEL, *flags)


def kv_role(name: str) -> tuple[str, ...]:
    """The flags of a prefill or decode instance of the test deployment."""
    return ("--role", name, "--kv-secret", KV_SECRET)


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


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of the server's ``tandem:<name>`` samples whose labels include ``labels``
    (``name`` as exposed: counters end in ``_total``, histograms in ``_count``...).
    Waits out the server's rendering interval first, so the figures include what
    happened before the call."""
    time.sleep(RENDER_INTERVAL)
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for sample in family.samples:
            if sample.name == f"tandem:{name}" and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (a server's cores, and their tensor-parallel ranks)."""
    children = child_pids(pid)
    return children + [d for child in children for d in descendants(child)]


def core_pids(server_pid: int) -> list[int]:
    """A server's engine-core processes (multiprocessing's spawned children)."""
    return [pid for pid in child_pids(server_pid) if b"spawn_main" in cmdline(pid)]
