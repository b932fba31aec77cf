"""EngineCoreClient: the API server's side of the engine-core process.

Starts the core (core_process.py) with multiprocessing's spawn (a fresh interpreter:
no forked torch threads), waits until it has loaded the model, and talks to it over
ZeroMQ: a PUSH socket for requests, aborts and calls, a PULL socket read by a
receiver thread that decodes outputs and hands them to the event loop. The sockets
live on Unix-domain paths in a private temporary folder, bound here.

A watcher thread waits on the process: if the core dies (a crash, the OOM killer,
``kill -9``), every stream in flight ends with an EngineDeadError frame, later
requests and ``/health`` get 503, and ``on_dead`` runs (``tandem serve`` then exits
non-zero, so that a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import msgspec
import zmq

from tandem.config import EngineConfig
from tandem.engine.input_processor import EngineRequest
from tandem.errors import EngineDeadError, TandemError
from tandem.serving.core_process import (
    AbortRequests,
    AddRequest,
    CallCore,
    CallResult,
    CoreOptions,
    FromCore,
    Shutdown,
    StepOutputs,
    run_engine_core,
)
from tandem.serving.engine_client import EngineClient

logger = logging.getLogger("tandem.server")


class EngineCoreClient(EngineClient):
    def __init__(
        self,
        config: EngineConfig,
        options: CoreOptions,
        on_dead: Callable[[str], None] | None = None,
        start_timeout: float = 600.0,
    ) -> None:
        """Start the core process and wait until it is ready; a core that cannot load
        its model raises TandemError with its reason."""
        self.on_dead = on_dead
        self.options = options
        self.name = f"engine {options.name}"
        self._closing = False
        self._folder = Path(tempfile.mkdtemp(prefix="tandem-core-"))
        input_address = f"ipc://{self._folder / 'input'}"
        output_address = f"ipc://{self._folder / 'output'}"
        self.context = zmq.Context()
        self._to_core = self.context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(input_address)
        self._from_core = self.context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.bind(output_address)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        ours, theirs = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, options, input_address, output_address, theirs),
            name="tandem-engine-core",
            daemon=True,
        )
        self.process.start()
        theirs.close()
        self._pipe = ours  # held open: the core stops when it closes (we are gone)
        try:
            info = self._wait_ready(start_timeout)
        except BaseException:
            self._stop_process()
            self._close_sockets()
            raise
        super().__init__(config, info)
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._receive, name="core-outputs", daemon=True),
            threading.Thread(target=self._watch, name="core-watch", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        logger.info("%s running in process %d", self.name, self.process.pid)

    def _wait_ready(self, timeout: float):
        ready = wait([self._pipe, self.process.sentinel], timeout)
        if not ready:
            raise TandemError(f"the {self.name} did not start in {timeout:.0f} s")
        if self._pipe in ready:
            with contextlib.suppress(EOFError):
                kind, payload = self._pipe.recv()
                if kind == "ready":
                    return payload
                raise TandemError(payload)
        self.process.join(5)
        raise TandemError(
            f"the {self.name} process exited with code {self.process.exitcode} while starting"
        )

    # -- the transport ----------------------------------------------------------------

    def _send(self, message) -> None:
        """Never blocks (the event loop calls it): a core that is not reading, being
        dead or stuck, is an EngineDeadError."""
        data = self._encoder.encode(message)
        try:
            with self._send_lock:
                self._to_core.send(data, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("the engine core is not reading its input") from None

    async def _request(self, make: Callable[[int], Any]) -> Any:
        """Send ``make(call_id)`` and wait for the core's CallResult."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        self._loop = loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls[call_id] = future
        try:
            self._send(make(call_id))
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def _send_add(self, request: EngineRequest) -> None:
        await self._request(lambda call_id: AddRequest(call_id, request))

    def _send_abort(self, request_id: str) -> None:
        if self.dead_reason is None:
            with contextlib.suppress(EngineDeadError):  # (it dies: its requests go too)
                self._send(AbortRequests([request_id]))

    async def start_trace(self) -> None:
        await self._request(lambda call_id: CallCore(call_id, "start_trace"))

    async def stop_trace(self) -> dict[str, Any] | None:
        return await self._request(lambda call_id: CallCore(call_id, "stop_trace"))

    async def render_metrics(self) -> str:
        return await self._request(lambda call_id: CallCore(call_id, "metrics"))

    # -- the receiver and watcher threads ----------------------------------------------

    def _receive(self) -> None:
        decoder = msgspec.msgpack.Decoder(FromCore)
        while not self._stopping.is_set():
            if not self._from_core.poll(100):
                continue
            try:
                message = decoder.decode(self._from_core.recv(copy=False).buffer)
            except msgspec.DecodeError:  # a bug: say so, keep the other streams flowing
                logger.exception("undecodable message from the engine core")
                continue
            loop = self._loop
            if loop is None or loop.is_closed():
                continue  # nobody asked anything yet
            if isinstance(message, StepOutputs):
                loop.call_soon_threadsafe(self._deliver, message.outputs, message.failures)
            else:
                loop.call_soon_threadsafe(self._resolve, message)

    def _resolve(self, result: CallResult) -> None:
        future = self._calls.pop(result.call_id, None)
        if future is None or future.done():
            return  # its caller went away
        if result.failure is not None:
            future.set_exception(result.failure.exception())
        else:
            future.set_result(result.value)

    def _watch(self) -> None:
        wait([self.process.sentinel])
        if self._closing:
            # _stop_process reaps it. Two threads joining one process race in
            # waitpid: the loser's join returned at once with the process "alive",
            # and a clean shutdown logged "did not stop in 30 s" and terminated it.
            return
        self.process.join(timeout=5)  # reaped: exitcode is set only once it is
        reason = f"the {self.name} process exited with code {self.process.exitcode}"
        logger.error("%s; failing the requests in flight", reason)
        self.dead_reason = reason
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._died, reason)
        if self.on_dead is not None:
            self.on_dead(reason)

    def _died(self, reason: str) -> None:
        self._core_died(reason)
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the core (it writes its trace, closes its KV listener) and clean up."""
        self._closing = True
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                self._send(Shutdown())
        self._stop_process()
        self._stopping.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._close_sockets()

    def _stop_process(self) -> None:
        self._closing = True
        self.process.join(timeout=30)
        if self.process.is_alive():
            logger.warning("the %s did not stop in 30 s; terminating it", self.name)
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._pipe.close()

    def _close_sockets(self) -> None:
        self._to_core.close()
        self._from_core.close()
        self.context.term()
        shutil.rmtree(self._folder, ignore_errors=True)
