"""DataParallelClient: N engine cores behind one API server (``--data-parallel-size``).

Each core is a whole engine (core_client.py: its own process, scheduler, KV cache and,
with ``--tensor-parallel-size``, its own group of ranks) on its own run of this host's
CPUs. Requests are placed by the router's policies (serving/placement.py): the fewest
requests in flight (round robin among equals), or with ``--data-parallel-routing
prefix`` the core the prompt's first KV block maps to, whose prefix cache likely
holds it, unless that core is busier than the others by more than AFFINITY_SLACK. A
request's outputs and its abort go to the core that took it. As vLLM does,
``/metrics`` is every core's metrics, each sample labelled ``engine="<index>"`` (sum
over it for the server's totals), and ``tandem:engine_cores`` counts the cores alive
and dead.

A core that dies fails only its own streams (engine_dead); requests go on to the
others, ``/health`` says "degraded" and names the dead core, and the server exits
non-zero (``on_dead``) only when the last core is gone.

    handler -> DataParallelClient --least_busy--> EngineCoreClient i -> core process i
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from tandem.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from tandem.engine.block_pool import block_digest
from tandem.engine.input_processor import EngineRequest
from tandem.errors import EngineDeadError, InvalidParameterError
from tandem.executor.cpus import allowed_cpus, numa_nodes, rank_cpus
from tandem.serving.core_client import EngineCoreClient
from tandem.serving.engine_client import EngineClient
from tandem.serving.placement import Instance, prefix_affinity
from tandem.serving.served_engine import CoreOptions

logger = logging.getLogger("tandem.server")

MAX_DATA_PARALLEL = 64
ROUTINGS = ("least-busy", "prefix")
# Prefix routing sends a request to its prompt's core unless that core has this many
# more requests in flight than the least busy one.
AFFINITY_SLACK = 4


def check_data_parallel(
    config: EngineConfig, size: int, engine_process: bool, routing: str = "least-busy"
) -> None:
    """Refuse the layouts data parallelism does not serve, naming the setting."""
    if routing not in ROUTINGS:
        raise InvalidParameterError(
            "--data-parallel-routing", f"{routing!r} is not one of {', '.join(ROUTINGS)}"
        )
    if not 1 <= size <= MAX_DATA_PARALLEL:
        raise InvalidParameterError(
            "--data-parallel-size", f"must be in [1, {MAX_DATA_PARALLEL}], got {size}"
        )
    if size == 1:
        return
    if not engine_process:
        raise InvalidParameterError(
            "--data-parallel-size", "needs the engine cores in their own processes "
            "(drop --no-engine-process)",
        )  # fmt: skip
    if config.parallel.nnodes > 1:
        raise InvalidParameterError(
            "--data-parallel-size", "with --nnodes > 1 is not served: one engine core's "
            "ranks span the hosts; run a server per host behind `tandem router`",
        )  # fmt: skip
    if config.parallel.distributed_executor_backend != "mp":
        raise InvalidParameterError(
            "--data-parallel-size", "needs --distributed-executor-backend mp (this server "
            "starts each core's ranks)",
        )  # fmt: skip
    transfer = config.kv_transfer
    if transfer is not None and transfer.role != "both":
        raise InvalidParameterError(
            "--data-parallel-size", "a disaggregated role runs one engine core (its KV "
            "listener has one port); run several servers behind `tandem router`",
        )  # fmt: skip


def core_config(config: EngineConfig, size: int) -> EngineConfig:
    """A core's config: on a CPU with no KV cache size given, the server's default
    budget split between its cores (each would otherwise take all of it)."""
    cache = config.cache
    if config.device != "cpu" or cache.num_blocks is not None or cache.kv_cache_memory is not None:
        return config
    return replace(config, cache=replace(cache, kv_cache_memory=DEFAULT_CPU_KV_CACHE_BYTES // size))


def core_cpus(cpus: list[int], size: int, index: int) -> list[int]:
    """Core ``index``'s own CPUs: a run of them, the first CPU left to the API server
    (it encodes every stream's chunks). Where there is no CPU to spare, none: pinned
    cores would stall whenever the server ran on their CPUs (measured on 2 vCPUs:
    docs/lab-notes/parallelism.md)."""
    if len(cpus) <= size:
        return []
    rest = cpus[1:]
    return rank_cpus(rest, size, index, numa_nodes(rest))[0]  # (a NUMA node each, where even)


def core_options(options: CoreOptions, size: int, index: int, bind: bool) -> CoreOptions:
    """Core ``index``'s options: its own CPUs (``bind``: core_cpus), else the cores
    share the CPUs, their thread counts split; and its own trace file."""
    cpus = allowed_cpus()
    share = core_cpus(cpus, size, index) if bind else []
    threads = options.threads or (0 if share or not cpus else max(1, len(cpus) // size))
    trace = options.trace
    if trace is not None:
        path = Path(trace)
        trace = str(path.with_name(f"{path.stem}.core{index}{path.suffix or '.json'}"))
    return replace(options, index=index, cpus=tuple(share), threads=threads, trace=trace)


class DataParallelClient(EngineClient):
    def __init__(
        self,
        config: EngineConfig,
        options: CoreOptions,
        size: int,
        on_dead: Callable[[str], None] | None = None,
        routing: str = "least-busy",
    ) -> None:
        """Start ``size`` cores at once (they load the model side by side) and wait for
        all; if one cannot start, the others are stopped and its reason raised.
        ``routing``: least-busy, or prefix (cache affinity)."""
        self.on_dead = on_dead
        self.routing = routing
        self._size = size
        self._dead: dict[int, str] = {}
        self._dead_lock = threading.Lock()
        bind = config.parallel.cpu_bind == "auto"

        def start(index: int) -> EngineCoreClient:
            return EngineCoreClient(
                core_config(config, size),
                core_options(options, size, index, bind),
                on_dead=lambda reason: self._core_died_at(index, reason),
            )

        with ThreadPoolExecutor(size, thread_name_prefix="core-start") as pool:
            futures = [pool.submit(start, index) for index in range(size)]
        failures = [f.exception() for f in futures if f.exception() is not None]
        if failures:
            for future in futures:
                if future.exception() is None:
                    future.result().shutdown()
            raise failures[0]
        self.cores: list[EngineCoreClient] = [future.result() for future in futures]
        self._instances = [Instance(str(index)) for index in range(size)]
        super().__init__(config, self.cores[0].info)
        logger.info(
            "%d engine cores (data parallel), CPUs %s", size,
            "; ".join(f"{i}: {list(c.options.cpus) or 'shared'}" for i, c in enumerate(self.cores)),
        )  # fmt: skip

    # -- placing requests ------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return sum(core.in_flight for core in self.cores)

    def owns(self, request_id: str) -> bool:
        return any(core.owns(request_id) for core in self.cores)

    def _pick(self, key: bytes | None = None) -> EngineCoreClient:
        dead = set()
        for core, instance in zip(self.cores, self._instances, strict=True):
            instance.in_flight = core.in_flight
            if not core.is_alive:
                dead.add(instance.url)
        choice = prefix_affinity(self._instances, key, AFFINITY_SLACK, skip=dead)
        if choice is None:
            raise EngineDeadError(self.dead_reason or "every engine core has died")
        return self.cores[int(choice.url)]

    async def submit(self, request: EngineRequest, outputs: asyncio.Queue) -> None:
        """To the core the routing picks: the least busy, or (``prefix``) the one the
        prompt's first KV block maps to unless it is busier than the others by more
        than AFFINITY_SLACK requests."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        await self._pick(self._affinity_key(request)).submit(request, outputs)

    def _affinity_key(self, request: EngineRequest) -> bytes | None:
        block = self.info.block_size
        if self.routing != "prefix" or len(request.prompt_token_ids) < block:
            return None
        return block_digest(None, request.prompt_token_ids[:block], request.cache_salt)

    def abort(self, request_id: str) -> None:
        for core in self.cores:
            if core.owns(request_id):
                core.abort(request_id)
                return

    # -- calls to every core -----------------------------------------------------------

    def _alive(self) -> list[tuple[int, EngineCoreClient]]:
        return [(index, core) for index, core in enumerate(self.cores) if core.is_alive]

    async def _each(self, call: Callable[[EngineCoreClient], Any]) -> list[tuple[int, Any]]:
        """``call`` on every live core at once: (index, result) for those that answered
        (a core that dies meanwhile is left out; any other error is raised)."""
        alive = self._alive()
        results = await asyncio.gather(*(call(core) for _, core in alive), return_exceptions=True)
        answered = []
        for (index, _), result in zip(alive, results, strict=True):
            if isinstance(result, EngineDeadError):
                continue
            if isinstance(result, BaseException):
                raise result
            answered.append((index, result))
        return answered

    async def render_metrics(self) -> str:
        texts = await self._each(lambda core: core.render_metrics())
        return merge_metrics(texts, alive=len(self._alive()), total=len(self.cores))

    async def start_trace(self) -> None:
        await self._each(lambda core: core.start_trace())

    async def stop_trace(self) -> dict[str, Any] | None:
        traces = [(i, t) for i, t in await self._each(lambda core: core.stop_trace()) if t]
        return merge_traces(traces) if traces else None

    def health(self) -> dict:
        # (A core's own client knows first: its streams fail before on_dead runs.)
        dead = {i: core.dead_reason for i, core in enumerate(self.cores) if not core.is_alive}
        if not dead:
            return {"status": "ok", "engine_cores": len(self.cores)}
        return {
            "status": "degraded",
            "engine_cores": len(self.cores),
            "dead_engine_cores": {str(index): reason for index, reason in sorted(dead.items())},
        }

    # -- faults and shutdown -------------------------------------------------------------

    def _core_died_at(self, index: int, reason: str) -> None:
        """(The core's watcher thread.) Its own streams have failed; the last one to die
        takes the server with it."""
        with self._dead_lock:
            self._dead[index] = reason
            left = self._size - len(self._dead)
        if left > 0:
            logger.error("%s; its requests failed, %d engine core(s) go on serving", reason, left)
            return
        self.dead_reason = f"every engine core has died (last: {reason})"
        if self.on_dead is not None:
            self.on_dead(self.dead_reason)

    def shutdown(self) -> None:
        with ThreadPoolExecutor(len(self.cores), thread_name_prefix="core-stop") as pool:
            list(pool.map(lambda core: core.shutdown(), self.cores))


def merge_metrics(texts: list[tuple[int, bytes | str]], alive: int, total: int) -> str:
    """Every core's exposition text as one, each sample labelled with its core's
    ``engine`` index, and ``tandem:engine_cores`` by state."""
    families: dict[str, Metric] = {}
    for index, text in texts:
        if isinstance(text, bytes):
            text = text.decode()
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples.extend(
                sample._replace(labels={**sample.labels, "engine": str(index)})
                for sample in family.samples
            )
    cores = GaugeMetricFamily(
        "tandem:engine_cores", "Data-parallel engine cores by state.", labels=["state"]
    )
    cores.add_metric(["alive"], alive)
    cores.add_metric(["dead"], total - alive)

    class Merged:
        def collect(self):
            return [*families.values(), cores]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry).decode()


def merge_traces(traces: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The cores' Chrome traces as one: core i's processes renumbered apart from the
    others' and named after it. Each core's clock starts when it was told to trace (the
    cores are told at once: they line up to within the message's delivery)."""
    events: list[dict[str, Any]] = []
    dropped: dict[str, int] = {}
    stride = 1 + max(event.get("pid", 0) for _, trace in traces for event in trace["traceEvents"])
    for index, trace in traces:
        for event in trace["traceEvents"]:
            event = {**event, "pid": event.get("pid", 0) + index * stride}
            if event.get("ph") == "M" and event.get("name") == "process_name":
                event["args"] = {"name": f"core {index}: {event['args']['name']}"}
            events.append(event)
        for key, value in trace.get("otherData", {}).get("dropped", {}).items():
            dropped[key] = dropped.get(key, 0) + value
    first = traces[0][1]
    return {**first, "traceEvents": events, "otherData": {"dropped": dropped}}


def start_engine(
    config: EngineConfig,
    options: CoreOptions,
    data_parallel_size: int,
    on_dead: Callable[[str], None] | None,
    routing: str = "least-busy",
) -> EngineClient:
    """One engine core in its own process, or ``data_parallel_size`` of them."""
    if data_parallel_size == 1:
        return EngineCoreClient(config, options, on_dead)
    return DataParallelClient(config, options, data_parallel_size, on_dead, routing)
