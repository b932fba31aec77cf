"""AsyncEngine: the engine's step loop on a thread of its own, fed from asyncio.

The engine is not thread-safe and a step is heavy (a forward pass), so exactly one
thread, the engine thread, ever touches it. The event loop validates a request first
(the InputProcessor: tokenizing, limits; a bad request fails its own call with
nothing queued), then talks to the engine thread through an inbox of commands (add,
abort) and gets outputs back on per-request asyncio queues:

    HTTP handler: InputProcessor.process --add--> inbox --> engine thread: engine.add
                                                   loop: drain inbox, engine.step()
    HTTP handler <--asyncio.Queue-- RequestOutput (or an exception) per step

Outputs are whatever the request's ``output_kind`` asks for (the server asks for
deltas when streaming and the final output otherwise). A request that fails alone
(its output has ``error``: the engine isolated it) ends its own stream with a
RequestFailedError; an exception out of a whole step (the shared forward pass) fails
the requests in flight and the loop goes on serving new ones. Aborts are
fire-and-forget: a disconnected client's blocks are freed before the next step.
Metrics and traces watch the engine itself (EngineObserver), not these queues.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.engine import Engine, PromptInput
from tandem.engine.observer import EngineObserver
from tandem.errors import TandemError
from tandem.outputs import RequestOutput
from tandem.sampling import SamplingParams
from tandem.server.errors import QueueFullError

logger = logging.getLogger("tandem.server")


class EngineStepError(TandemError):
    """A step failed (a bug or an out-of-memory); the requests in it are lost."""


class RequestFailedError(TandemError):
    """One request failed inside the engine (the others went on)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_output_tokens: int = 0


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_waiting_requests: int | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        if observer is not None:
            engine.add_observer(observer)
        self._inbox: queue.SimpleQueue[tuple[Callable[[], Any], Any] | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- called from the event loop ------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        outputs: asyncio.Queue,
        kv_transfer_params: dict | None = None,
    ) -> None:
        """Queue a request whose RequestOutputs (as its ``output_kind`` says, the last
        with ``finished``) go to ``outputs``. Raises the validation error, or
        QueueFullError, with nothing queued."""
        loop = asyncio.get_running_loop()
        # Only a disaggregated role (an engine with a KV connector) can keep blocks or
        # pull them; a colocated server computes such a request as any other.
        transfer = kv_transfer_params if self.engine.scheduler.connector else None
        # Tokenizing a long prompt takes milliseconds: off the event loop, so that other
        # clients' streams keep flowing (the input processor only reads its settings).
        request = await asyncio.to_thread(
            self.engine.input_processor.process,
            request_id, prompt, params, kv_transfer_params=transfer,
        )  # fmt: skip
        if request.kv_transfer is not None:  # forged or foreign parameters: refused here
            self.engine.scheduler.connector.check(request)

        def add() -> None:
            waiting = len(self.engine.scheduler.waiting)
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise QueueFullError(
                    f"{waiting} requests are waiting (the limit is "
                    f"{self.max_waiting_requests}); retry later"
                )
            self.engine.add(request)  # outputs come from steps, on this thread, later
            self._streams[request_id] = _Stream(loop, outputs)

        await self._call(add)

    def submit(self, function: Callable[[], Any]) -> None:
        """Run ``function`` on the engine thread between steps (fire and forget)."""
        self._inbox.put((function, None))

    def fail(self, request_id: str, error: Exception) -> None:
        """(Engine thread) end a request's stream with ``error``; the engine has already
        dropped the request."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    def abort(self, request_id: str) -> None:
        """End a request and free its blocks; safe to call for finished or unknown ids
        and from any thread."""
        self._inbox.put((lambda: self._abort(request_id), None))

    async def call(self, function: Callable[[Engine], Any]) -> Any:
        """Run ``function(engine)`` on the engine thread between steps."""
        return await self._call(lambda: function(self.engine))

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    async def _call(self, function: Callable[[], Any]) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((function, future))
        return await asyncio.wrap_future(future)

    # -- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
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
                self._execute(*command)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    command = False
            if self.engine.has_unfinished_requests():
                self._step()

    @staticmethod
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

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            error = EngineStepError(f"the engine failed while running this request: {exc}")
            for request_id in list(self._streams):
                self._abort(request_id, error)
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
            if output.finished:
                del self._streams[output.request_id]
                _log_finished(output, stream.num_output_tokens)
            item: RequestOutput | Exception = output
            if output.error is not None:
                item = RequestFailedError(f"this request failed in the engine: {output.error}")
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _abort(self, request_id: str, error: Exception | None = None) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.engine.abort(request_id)
        logger.info(
            "request %s aborted after %d output tokens", request_id, stream.num_output_tokens
        )
        if error is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self.engine.notify_changed()


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
