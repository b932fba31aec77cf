"""ServedEngine: an Engine as ``tandem serve`` runs it, wherever its core runs: the
model loaded, the Prometheus metrics watching it, the step trace (``--trace``), and
for a disaggregated role the KV connector. The engine-core process and the in-process
server (``--no-engine-process``) both build it here."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.config import EngineConfig

if TYPE_CHECKING:
    from tandem.engine.core import EngineCore
    from tandem.engine.engine import Engine
    from tandem.serving.disagg_connector import DisaggConnector
    from tandem.serving.metrics import ServerMetrics

logger = logging.getLogger("tandem.server")


@dataclass
class CoreOptions:
    """What serving needs besides the EngineConfig (picklable: it crosses to the
    core process)."""

    model_name: str  # the served name, for the metrics' labels
    max_waiting_requests: int | None = None
    trace: str | None = None  # write the step trace here at shutdown
    host: str = "127.0.0.1"  # the KV transfer listener's address (disaggregated roles)
    log_level: str = "info"
    threads: int = 0  # torch threads (0: torch's default, or one per CPU of ``cpus``)
    index: int | None = None  # this core's place among data-parallel cores
    cpus: tuple[int, ...] = ()  # data parallelism: this core's own CPUs (every thread pinned)

    @property
    def name(self) -> str:
        return "core" if self.index is None else f"core {self.index}"


class ServedEngine:
    def __init__(self, config: EngineConfig, options: CoreOptions) -> None:
        """Load the model (the one place it is loaded)."""
        if options.cpus:
            from tandem.executor.cpus import pin_threads

            pin_threads(options.cpus)
        if options.threads or options.cpus:
            import torch

            torch.set_num_threads(options.threads or len(options.cpus))
        from tandem.engine.engine import Engine
        from tandem.executor import make_executor
        from tandem.serving.metrics import ServerMetrics
        from tandem.trace.recorder import EngineTracing

        self.config, self.options = config, options
        self.engine: Engine = Engine(config, make_executor(config))
        self.metrics: ServerMetrics = ServerMetrics(options.model_name, self.engine.max_model_len)
        self.engine.add_observer(self.metrics)
        self.tracing = EngineTracing(self.engine)
        if options.trace is not None:
            self.tracing.start()
        self.engine.notify_changed()  # the gauges start from the idle engine
        self.connector: DisaggConnector | None = None

    def connect(self, core: EngineCore) -> None:
        """A disaggregated role's KV connector, driven through the core's loop."""
        transfer = self.config.kv_transfer
        if transfer is not None and transfer.role != "both":
            from tandem.serving.disagg_connector import DisaggConnector

            self.connector = DisaggConnector(core, self.metrics, transfer, self.options.host)

    def close(self) -> None:
        """After the core's loop has stopped: the KV listener, then the trace file."""
        if self.connector is not None:
            self.connector.close()
        if self.options.trace is not None and self.tracing.tracer is not None:
            self.tracing.stop(self.options.trace)
            logger.info("trace written to %s", self.options.trace)
