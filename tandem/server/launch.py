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
    with tandem_servers(args, launcher=launcher) as (server,):
        yield server


@contextlib.contextmanager
def tandem_servers(
    *commands: Sequence[str], launcher: Sequence[str] = ()
) -> Iterator[list[ServerProcess]]:
    """Several ``tandem_server``s started together, then waited for: a start is mostly
    imports and loading, which overlap (three servers are healthy in about the time of
    two one after another on 2 cores). Stopped together on exit."""
    ports: set[int] = set()
    while len(ports) < len(commands):  # distinct, though none is bound yet
        ports.add(free_port())
    with contextlib.ExitStack() as stack:
        servers: list[ServerProcess] = []
        logs = []
        stack.callback(lambda: _stop([server.process for server in servers]))
        for command, port in zip(commands, sorted(ports), strict=True):
            # The log goes to a file: an unread pipe would fill up and stall the server.
            logs.append(stack.enter_context(tempfile.TemporaryFile(mode="w+")))
            process = subprocess.Popen(
                [*launcher, sys.executable, "-m", "tandem", *command, "--port", str(port)],
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
                text=True,
            )
            servers.append(ServerProcess(f"http://127.0.0.1:{port}", process))
        for server, log in zip(servers, logs, strict=True):
            wait_healthy(server.url, server.process, log)
        yield servers


def _stop(processes: list[subprocess.Popen]) -> None:
    """Terminate them all, then wait for each (killed after 30 s)."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def tandem_process(*args: str, launcher: Sequence[str] = ()) -> Iterator[str]:
    """``tandem_server`` yielding just the base URL."""
    with tandem_server(*args, launcher=launcher) as server:
        yield server.url
