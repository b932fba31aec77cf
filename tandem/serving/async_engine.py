"""AsyncEngine: the engine core on a thread of the server's own process.

``tandem serve --no-engine-process`` (for debugging: one process, one debugger) and
in-process tests. The EngineCore loop runs on the ``tandem-engine`` thread; its
outputs are handed to the event loop with ``call_soon_threadsafe``. The default
server runs the core in its own process instead (core_client.py), so that HTTP,
JSON and the event loop never take the GIL from the step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from tandem.engine.core import EngineCore, RequestFailure
from tandem.engine.engine import Engine
from tandem.engine.input_processor import EngineRequest
from tandem.outputs import RequestOutput
from tandem.serving.engine_client import EngineClient
from tandem.serving.metrics import ServerMetrics
from tandem.trace.recorder import EngineTracing

logger = logging.getLogger("tandem.server")


class AsyncEngine(EngineClient):
    def __init__(
        self,
        engine: Engine,
        max_waiting_requests: int | None = None,
        metrics: ServerMetrics | None = None,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        """``metrics``: watches the engine (for /metrics); ``on_shutdown``: runs after
        the loop has stopped."""
        super().__init__(engine.config, engine.model_info)
        self.engine = engine
        self.tracing = EngineTracing(engine)
        self.metrics = metrics
        self.on_shutdown = on_shutdown
        if metrics is not None:
            engine.add_observer(metrics)
        self.core = EngineCore(engine, self._from_core, max_waiting_requests)
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.core.run()
        except BaseException as exc:  # a bug in the loop itself: say so, stop serving
            logger.exception("the engine thread stopped")
            self.dead_reason = f"the engine thread stopped: {exc}"
            self._on_loop(self._core_died, self.dead_reason)
            return
        if self.core.dead_reason is not None:  # its engine cannot go on
            self.dead_reason = f"the engine stopped: {self.core.dead_reason}"
            self._on_loop(self._core_died, self.dead_reason)

    def _from_core(self, outputs: list[RequestOutput], failures: list[RequestFailure]) -> None:
        self._on_loop(self._deliver, outputs, failures)

    def _on_loop(self, function, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(function, *args)

    async def _send_add(self, request: EngineRequest) -> None:
        await asyncio.wrap_future(self.core.call(lambda: self.core.add(request)))

    def _send_abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    async def start_trace(self) -> None:
        await asyncio.wrap_future(self.core.call(self.tracing.start))

    async def stop_trace(self):
        tracer = await asyncio.wrap_future(self.core.call(self.tracing.stop))
        return None if tracer is None else await asyncio.to_thread(tracer.chrome_trace)

    async def render_metrics(self) -> str:
        return "" if self.metrics is None else await asyncio.to_thread(self.metrics.render)

    def shutdown(self) -> None:
        self.core.stop()
        self._thread.join(timeout=30)
        if self.on_shutdown is not None:
            self.on_shutdown()
