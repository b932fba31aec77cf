"""Start ``tandem serve`` (or any ``tandem`` subcommand that serves HTTP) as a child
process on 127.0.0.1 and wait until it answers ``/health``: for benchmarks and tests
that need a real server."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx

from tandem.errors import TandemError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(base_url: str, process: subprocess.Popen | None = None, log=None, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            log.seek(0)
            raise TandemError(f"server exited with {process.returncode}:\n{log.read()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise TandemError(f"{base_url} did not become healthy in {timeout} s")


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen


@contextlib.contextmanager
def tandem_server(*args: str, launcher: Sequence[str] = ()) -> Iterator[ServerProcess]:
    """``python -m tandem <args> --port P`` as a child process, healthy; stopped on exit
    (tests that kill it on purpose use ``.process``). ``launcher`` prefixes the command,
    e.g. ``("taskset", "-c", "0")`` to pin it to a core."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    # The log goes to a file: an unread pipe would fill up and stall the server.
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(
            [*launcher, sys.executable, "-m", "tandem", *args, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_healthy(base_url, process, log)
            yield ServerProcess(base_url, process)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@contextlib.contextmanager
def tandem_process(*args: str, launcher: Sequence[str] = ()) -> Iterator[str]:
    """``tandem_server`` yielding just the base URL."""
    with tandem_server(*args, launcher=launcher) as server:
        yield server.url
