"""EngineCore: the engine's busy loop, the one thread that ever touches an Engine.

The engine is not thread-safe and a step is heavy (a forward pass). Commands (add,
abort, calls) arrive from any thread on an inbox and run between steps; after each
step the outputs leave in one batch through ``emit``. Idle, the loop sleeps on the
inbox; busy, it takes what is there and steps again:

    any thread: submit / call / abort --> inbox --> core thread: run the command
                                                    loop: drain inbox, engine.step()
    emit(outputs, failures) <-- after every step (and when a request is failed)

The same loop runs on a thread of the server's process (serving/async_engine.py,
``--no-engine-process``) or as the main thread of the engine-core process
(serving/core_process.py), where ``emit`` hands the batch to the thread that sends it.

A request that fails alone (its output has ``error``: the engine isolated it) ends
with a RequestFailure; an exception out of a whole step (the shared forward pass)
fails every request in flight and the loop goes on serving new ones. An abort frees
the request's blocks before the next step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.engine import Engine
from tandem.engine.input_processor import EngineRequest
from tandem.errors import (
    EngineDeadError,
    EngineStepError,
    InvalidParameterError,
    QueueFullError,
    RequestFailedError,
    TandemError,
)
from tandem.outputs import RequestOutput

logger = logging.getLogger("tandem.engine")

# What a failure's ``kind`` says, in the order an exception is matched.
_FAILURE_KINDS: dict[str, type[TandemError]] = {
    "invalid_parameter": InvalidParameterError,
    "queue_full": QueueFullError,
    "request_failed": RequestFailedError,
    "step_failed": EngineStepError,
    "engine_dead": EngineDeadError,
    "error": TandemError,
}


@dataclass
class RequestFailure:
    """Why a request (or a call) ended in an error, as plain data: it crosses threads
    and processes, and becomes the same exception class on the other side."""

    request_id: str
    kind: str  # a key of _FAILURE_KINDS
    message: str
    param: str | None = None  # for invalid_parameter: the field at fault

    @classmethod
    def of(cls, request_id: str, exc: BaseException) -> RequestFailure:
        for kind, error_type in _FAILURE_KINDS.items():
            if isinstance(exc, error_type):
                message = str(exc)
                param = getattr(exc, "param", None)
                if param is not None:  # InvalidParameterError prefixes its param
                    message = message.removeprefix(f"{param}: ")
                return cls(request_id, kind, message, param)
        return cls(request_id, "error", f"internal error: {type(exc).__name__}: {exc}")

    def exception(self) -> TandemError:
        if self.kind == "invalid_parameter":
            return InvalidParameterError(self.param or "request", self.message)
        return _FAILURE_KINDS.get(self.kind, TandemError)(self.message)


Emit = Callable[[list[RequestOutput], list[RequestFailure]], None]


class EngineCore:
    def __init__(self, engine: Engine, emit: Emit, max_waiting_requests: int | None = None):
        """``emit(outputs, failures)`` is called on the core thread after every step
        with the step's outputs (as each request's ``output_kind`` asks) and the
        requests that failed; it must not block."""
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._emit = emit
        self._inbox: queue.SimpleQueue[tuple[Callable[[], Any], Any] | None] = queue.SimpleQueue()
        self._live: dict[str, int] = {}  # requests in flight -> output tokens so far
        # Why the engine cannot go on (a tensor-parallel rank died or hung): ``run``
        # returns, and whoever runs the core stops serving.
        self.dead_reason: str | None = None

    # -- any thread ------------------------------------------------------------------

    def submit(self, function: Callable[[], Any]) -> None:
        """Run ``function`` on the core thread between steps (fire and forget)."""
        self._inbox.put((function, None))

    def call(self, function: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``function`` on the core thread between steps; its result or exception
        comes back in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((function, future))
        return future

    def abort(self, request_id: str) -> None:
        """End a request and free its blocks; safe for finished or unknown ids."""
        self.submit(lambda: self._abort(request_id))

    def stop(self) -> None:
        """``run`` returns after the command or step in progress."""
        self._inbox.put(None)

    # -- the core thread ------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Queue a validated request (InputProcessor). Raises, with nothing queued,
        when the waiting queue is full or the KV connector refuses its parameters."""
        connector = self.engine.scheduler.connector
        if request.kv_transfer is not None and connector is not None:
            connector.check(request)  # forged or foreign parameters: refused here
        waiting = len(self.engine.scheduler.waiting)
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} requests are waiting (the limit is {self.max_waiting_requests}); "
                "retry later"
            )
        self.engine.add(request)  # its outputs come from later steps
        self._live[request.request_id] = 0

    def fail(self, request_id: str, error: Exception) -> None:
        """End a request's stream with ``error``; the engine has already dropped it."""
        if self._live.pop(request_id, None) is not None:
            self._emit([], [RequestFailure.of(request_id, error)])

    def run(self) -> None:
        """Serve commands and steps until ``stop``."""
        while True:
            # Idle: sleep until a command arrives. Busy: take what is there, then step.
            idle = not self.engine.has_unfinished_requests()
            try:
                command = self._inbox.get(block=idle)
            except queue.Empty:
                command = False
            while command is not False:
                if command is None:
                    return
                _execute(*command)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    command = False
            if self.engine.has_unfinished_requests():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            error = EngineStepError(f"the engine failed while running this request: {exc}")
            if isinstance(exc, EngineDeadError):  # no step can run again: stop serving
                error, self.dead_reason = exc, str(exc)
                self.stop()
            failures = [RequestFailure.of(request_id, error) for request_id in self._live]
            for request_id in list(self._live):
                self._abort(request_id, notify=False)
            self.engine.notify_changed()
            self._emit([], failures)
            return
        delivered, failures = [], []
        for output in outputs:
            count = self._live.get(output.request_id)
            if count is None:
                continue
            count += sum(len(c.token_ids) for c in output.outputs)
            self._live[output.request_id] = count
            if output.finished:
                del self._live[output.request_id]
                _log_finished(output, count)
            if output.error is not None:
                message = f"this request failed in the engine: {output.error}"
                failures.append(RequestFailure.of(output.request_id, RequestFailedError(message)))
            else:
                delivered.append(output)
        if delivered or failures:
            self._emit(delivered, failures)

    def _abort(self, request_id: str, notify: bool = True) -> None:
        count = self._live.pop(request_id, None)
        if count is None:
            return
        self.engine.abort(request_id)
        logger.info("request %s aborted after %d output tokens", request_id, count)
        if notify:
            self.engine.notify_changed()


def _execute(function: Callable[[], Any], future: concurrent.futures.Future | None) -> None:
    try:
        result = function()
    except Exception as exc:
        if future is None:
            logger.exception("engine command failed")
        else:
            future.set_exception(exc)
        return
    if future is not None:
        future.set_result(result)


def _log_finished(output: RequestOutput, num_output_tokens: int) -> None:
    metrics = output.metrics
    ttft = f"{metrics.ttft * 1e3:.1f} ms" if metrics and metrics.ttft is not None else "n/a"
    logger.info(
        "request %s: %d prompt tokens (%d cached), %d output tokens, TTFT %s, finish %s",
        output.request_id,
        len(output.prompt_token_ids),
        output.num_cached_tokens,
        num_output_tokens,
        ttft,
        ",".join(str(c.finish_reason) for c in output.outputs),
    )
