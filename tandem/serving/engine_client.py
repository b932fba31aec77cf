"""EngineClient: what the HTTP layer talks to, wherever the engine core runs.

The server validates and tokenizes a request itself (the InputProcessor, on a worker
thread: a bad request fails its own call with nothing sent to the core), registers
the request's output queue, then hands the EngineRequest to the core and waits for
its acknowledgement (a full queue or refused transfer parameters fail the call).
Outputs come back as RequestOutputs (or an exception that ends the stream) on the
request's asyncio queue:

    handler --InputProcessor--> EngineRequest --add--> core (a thread or a process)
    handler <--asyncio.Queue-- RequestOutput | exception, per step

Two transports implement ``_send_add``, ``abort`` and the calls: AsyncEngine (the
core on a thread of this process, ``--no-engine-process``) and EngineCoreClient (the
core in its own process, over ZeroMQ). The queues are only touched on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.core import RequestFailure
from tandem.engine.input_processor import EngineRequest, InputProcessor, PromptInput
from tandem.errors import EngineDeadError, TandemError
from tandem.outputs import RequestOutput
from tandem.sampling import SamplingParams
from tandem.step import RunnerInfo


class EngineClient:
    def __init__(self, config: EngineConfig, info: RunnerInfo) -> None:
        self.config = config
        self.info = info
        self.input_processor = InputProcessor.of(info)
        # Only a disaggregated role (an engine with a KV connector) can keep blocks or
        # pull them; a colocated server computes such a request as any other.
        transfer = config.kv_transfer
        self.transfers_kv = transfer is not None and transfer.role != "both"
        self.dead_reason: str | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    @property
    def in_flight(self) -> int:
        """Requests added and not yet finished, failed or aborted."""
        return len(self._streams)

    def owns(self, request_id: str) -> bool:
        return request_id in self._streams

    def health(self) -> dict:
        """``/health``'s body while the server serves."""
        return {"status": "ok"}

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        outputs: asyncio.Queue,
        kv_transfer_params: dict | None = None,
    ) -> None:
        """Queue a request whose RequestOutputs (as its ``output_kind`` says, the last
        with ``finished``) go to ``outputs``. Raises the validation error, or the
        core's refusal (QueueFullError...), with nothing queued."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        request = await self.prepare(request_id, prompt, params, kv_transfer_params)
        await self.submit(request, outputs)

    async def prepare(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> EngineRequest:
        """The validated, tokenized request (or the validation error)."""
        # Tokenizing a long prompt takes milliseconds: off the event loop, so that other
        # clients' streams keep flowing (the input processor only reads its settings).
        return await asyncio.to_thread(
            self.input_processor.process,
            request_id, prompt, params,
            kv_transfer_params=kv_transfer_params if self.transfers_kv else None,
        )  # fmt: skip

    async def submit(self, request: EngineRequest, outputs: asyncio.Queue) -> None:
        """Hand a processed request to the core; its outputs go to ``outputs``."""
        self._loop = asyncio.get_running_loop()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        request_id = request.request_id
        # Registered first: the core may send outputs before its acknowledgement.
        self._streams[request_id] = outputs
        try:
            await self._send_add(request)
        except BaseException as exc:
            self._streams.pop(request_id, None)
            if not isinstance(exc, TandemError):  # cancelled: the core may have taken it
                self._send_abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """End a request and free its blocks (fire and forget); safe for finished or
        unknown ids. Called on the event loop."""
        self._streams.pop(request_id, None)
        self._send_abort(request_id)

    # -- the transport ----------------------------------------------------------------

    async def _send_add(self, request: EngineRequest) -> None:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def start_trace(self) -> None:
        raise NotImplementedError

    async def stop_trace(self) -> dict[str, Any] | None:
        """The Chrome trace recorded since ``start_trace``, or None if none was."""
        raise NotImplementedError

    async def render_metrics(self) -> str:
        """The Prometheus exposition text of the core's metrics."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    # -- outputs, on the event loop ---------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput], failures: list[RequestFailure]) -> None:
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is None:
                continue  # aborted here; the core learns it soon
            if output.finished:
                del self._streams[output.request_id]
            queue.put_nowait(output)
        for failure in failures:
            queue = self._streams.pop(failure.request_id, None)
            if queue is not None:
                queue.put_nowait(failure.exception())

    def _core_died(self, reason: str) -> None:
        """The core stopped: every stream in flight ends with EngineDeadError, and so
        does every later request."""
        self.dead_reason = reason
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(EngineDeadError(reason))
