"""The engine-core process: the scheduler and runner loop, alone with its GIL.

``tandem serve`` starts it (core_client.py) and talks to it over two ZeroMQ sockets
on Unix-domain paths, with msgspec-encoded messages built on the engine's own plain
types (EngineRequest in, RequestOutput out):

    API server: PUSH --AddRequest | AbortRequests | CallCore | Shutdown--> PULL: input thread
    API server: PULL <--------------StepOutputs | CallResult-------------- PUSH: output thread

Three threads here: the input thread decodes messages and puts commands on the
EngineCore's inbox (metrics are rendered right there, off the loop); the main thread
is the EngineCore's busy loop (schedule, forward pass, sample, outputs); the output
thread encodes each step's outputs and sends them. Both socket threads spend their
time in ZeroMQ calls, which release the GIL, so the loop runs at nearly offline
speed. The model is loaded here, and only here; the API server gets the tokenizer
and the engine's limits (RunnerInfo) once, through the start-up pipe.

If the API server goes away (even killed), the start-up pipe closes and this process
stops; if this process dies, the API server notices (core_client.py).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from tandem.config import EngineConfig
from tandem.engine.core import EngineCore, RequestFailure
from tandem.engine.input_processor import EngineRequest
from tandem.errors import TandemError
from tandem.outputs import RequestOutput
from tandem.serving.served_engine import CoreOptions, ServedEngine

logger = logging.getLogger("tandem.server")


# -- messages: API server -> core ---------------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    call_id: int  # the CallResult that acknowledges it (or says why it was refused)
    request: EngineRequest


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class CallCore(msgspec.Struct, tag=True):
    call_id: int
    method: str  # one of CALLS


class Shutdown(msgspec.Struct, tag=True):
    pass


# -- messages: core -> API server ---------------------------------------------------


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    failures: list[RequestFailure]


class CallResult(msgspec.Struct, tag=True):
    call_id: int
    value: Any = None
    failure: RequestFailure | None = None


ToCore = AddRequest | AbortRequests | CallCore | Shutdown
FromCore = StepOutputs | CallResult
CALLS = ("start_trace", "stop_trace", "metrics")
DEAD_EXIT_STATUS = 3  # the core stopped itself: its engine cannot go on


def run_engine_core(
    config: EngineConfig,
    options: CoreOptions,
    input_address: str,
    output_address: str,
    pipe: Connection,
) -> None:
    """The process's main function (multiprocessing, spawned): load the model, say
    ready (or why not) on ``pipe``, then serve until Shutdown or the API server
    goes away."""
    logging.basicConfig(
        level=options.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {options.name}: %(message)s",
    )
    # Ctrl-C in a terminal reaches the whole process group: the server handles it and
    # shuts the core down in order (a core dying of it first would look like a crash).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core_process = _CoreProcess(config, options, input_address, output_address)
    except TandemError as exc:
        pipe.send(("error", str(exc)))
        return
    except Exception:
        pipe.send(("error", traceback.format_exc()))
        return
    # SIGTERM (a supervisor stopping the group): finish the step, then stop.
    signal.signal(signal.SIGTERM, lambda *_: core_process.core.stop())
    pipe.send(("ready", core_process.core.engine.model_info))
    threading.Thread(
        target=_stop_when_closed, args=(pipe, core_process.core), name="parent", daemon=True
    ).start()
    core_process.serve()
    if core_process.core.dead_reason is not None:  # the server sees this process end
        logger.error("the engine cannot go on: %s", core_process.core.dead_reason)
        raise SystemExit(DEAD_EXIT_STATUS)


def _stop_when_closed(pipe: Connection, core: EngineCore) -> None:
    """The API server holds the other end: EOF means it is gone (even killed)."""
    try:
        while True:
            pipe.recv()
    except (EOFError, OSError):
        core.stop()


class _CoreProcess:
    def __init__(
        self, config: EngineConfig, options: CoreOptions, input_address: str, output_address: str
    ) -> None:
        self.served = ServedEngine(config, options)
        self.metrics = self.served.metrics
        self._outbox: queue.SimpleQueue[FromCore | Callable[[], FromCore] | None] = (
            queue.SimpleQueue()
        )
        self.core = EngineCore(self.served.engine, self._emit, options.max_waiting_requests)
        self.served.connect(self.core)
        self._stopping = threading.Event()
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = self.context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)  # the last outputs leave on shutdown
        self.output.setsockopt(zmq.SNDTIMEO, 5000)
        self.output.connect(output_address)

    def serve(self) -> None:
        threads = [
            threading.Thread(target=self._receive, name="core-input", daemon=True),
            threading.Thread(target=self._send, name="core-output", daemon=True),
        ]
        for thread in threads:
            thread.start()
        try:
            self.core.run()
        finally:
            self._stopping.set()
            self._outbox.put(None)
            for thread in threads:
                thread.join(timeout=10)
            self._close()

    def _close(self) -> None:
        self.served.close()
        # Each socket was closed by its own thread (ZeroMQ sockets are not thread-safe);
        # a thread still stuck leaves its socket, and the context, to the process's end.
        if not self.input.closed or not self.output.closed:
            return
        self.context.term()

    # -- the output thread --------------------------------------------------------------

    def _emit(self, outputs: list[RequestOutput], failures: list[RequestFailure]) -> None:
        self._outbox.put(StepOutputs(outputs, failures))

    def _send(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while (message := self._outbox.get()) is not None:
                if callable(message):  # work that should not hold up the loop
                    message = message()
                try:
                    self.output.send(encoder.encode(message), copy=False)
                except zmq.Again:  # the API server has stopped reading: it is going away
                    logger.warning("the API server is not reading; an output was dropped")
        finally:
            self.output.close()

    # -- the input thread ---------------------------------------------------------------

    def _receive(self) -> None:
        try:
            self._receive_until_stopped()
        finally:
            self.input.close(linger=0)

    def _receive_until_stopped(self) -> None:
        decoder = msgspec.msgpack.Decoder(ToCore)
        while not self._stopping.is_set():
            if not self.input.poll(100):  # wakes up to see whether the loop has ended
                continue
            try:
                message = decoder.decode(self.input.recv(copy=False).buffer)
            except msgspec.DecodeError:
                logger.exception("undecodable message from the API server")
                continue
            if isinstance(message, AddRequest):
                self.core.submit(lambda m=message: self._add(m))
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    self.core.abort(request_id)
            elif isinstance(message, CallCore):
                self._call(message)
            else:  # Shutdown
                self.core.stop()
                return

    def _add(self, message: AddRequest) -> None:
        """(Core thread) queue it and acknowledge, or say why not."""
        try:
            self.core.add(message.request)
        except Exception as exc:
            failure = RequestFailure.of(message.request.request_id, exc)
            self._outbox.put(CallResult(message.call_id, failure=failure))
            return
        self._outbox.put(CallResult(message.call_id))

    def _call(self, message: CallCore) -> None:
        call_id = message.call_id
        if message.method == "metrics":  # thread-safe; rendered here, off the loop
            self._outbox.put(CallResult(call_id, self.metrics.render()))
            return
        if message.method not in CALLS:
            error = TandemError(f"unknown call {message.method!r}")
            self._outbox.put(CallResult(call_id, failure=RequestFailure.of("", error)))
            return
        tracing = self.served.tracing
        method = tracing.start if message.method == "start_trace" else tracing.stop

        def done(future) -> None:
            if future.exception() is not None:
                failure = RequestFailure.of("", future.exception())
                self._outbox.put(CallResult(call_id, failure=failure))
            elif message.method == "stop_trace":  # the JSON is built on the output thread
                tracer = future.result()
                self._outbox.put(
                    lambda: CallResult(call_id, None if tracer is None else tracer.chrome_trace())
                )
            else:
                self._outbox.put(CallResult(call_id))

        self.core.call(method).add_done_callback(done)
