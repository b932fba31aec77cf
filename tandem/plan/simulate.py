"""``tandem simulate``: the real engine (Scheduler, KV manager, output processor) on a
simulated clock, with a cost model in place of the model.

    workload (bench serve's generators, gamma arrivals)
      -> each request routed, at its arrival, to one of the Topology's instances (the
         router's policy; disaggregated: a prefill instance, then a decode instance
         once its K/V have crossed the link: kv_link.py)
      -> Engine.step() of each instance: the real scheduler decides the batch;
         SimulatedRunner "runs" it:
         the step's duration comes from the StepCostModel, the clock moves by it, every
         request that samples gets one token (never EOS: lengths come from the workload)
      -> each finished request's timeline -> the same summary as `tandem bench serve`

Nothing is computed but the schedule, so thousands of requests take seconds. The
engine is the one that serves (engine.py with a runner it is given), so a change to
the scheduler changes the simulation too. What it cannot see: preemption costs beyond
the recomputed tokens, and host effects the cost model does not fit.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass

from tandem.bench.client import RequestResult
from tandem.bench.datasets import BenchRequest
from tandem.config import EngineConfig
from tandem.engine import clock
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError, TandemError
from tandem.outputs import RequestOutput
from tandem.plan.cost import ModelShape, StepCostModel, shares_of, transfer_seconds
from tandem.plan.kv_link import SimulatedConnector
from tandem.runner.sampler import SampledToken
from tandem.sampling import RequestOutputKind, SamplingParams
from tandem.serving.placement import Instance, least_busy
from tandem.step import RunnerInfo, RunnerOutput, SpecDecodeStats
from tandem.trace.recorder import EngineTracing


class SimulatedClock:
    def __init__(self) -> None:
        self.time = 0.0

    def __call__(self) -> float:
        return self.time


class SimulatedRunner:
    """A runner that runs nothing: each step takes the cost model's time."""

    def __init__(
        self,
        shape: ModelShape,
        cost: StepCostModel,
        sim_clock: SimulatedClock,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.shape, self.cost, self.clock = shape, cost, sim_clock
        self.info = RunnerInfo(num_blocks, block_size, vocab_size, max_model_len, (), None)
        self.spec_stats = SpecDecodeStats()
        self.busy_s = 0.0  # simulated time spent in steps
        self.num_steps = 0
        self.last_step_ran = False

    def execute(self, scheduler_output) -> RunnerOutput:
        self.last_step_ran = bool(scheduler_output.scheduled)
        seconds = self.cost.step_seconds(self.shape, shares_of(scheduler_output.scheduled))
        self.clock.time += seconds
        self.busy_s += seconds
        self.num_steps += 1
        return RunnerOutput(
            sampled={
                item.request_id: [SampledToken(1)]
                for item in scheduler_output.scheduled
                if item.samples
            }
        )


@dataclass(frozen=True)
class Topology:
    """The instances a workload is served by, each an engine with the same model,
    hardware and settings: ``instances`` colocated ones, or ``prefill`` + ``decode``
    disaggregated ones whose prompts' K/V cross a link (each decode instance pulls
    over its own, one transfer at a time: ``link_latency_s`` + bytes / ``link_gbs``).
    Requests are routed as `tandem router` routes them (tandem/serving/placement.py);
    the router's own time (HTTP hops) is not counted."""

    instances: int = 1
    prefill: int = 0
    decode: int = 0
    link_gbs: float = 25.0  # a 200 Gb/s NIC
    link_latency_s: float = 1e-4
    local_prefill_threshold: int = 0  # shorter prompts skip the prefill instances

    def __post_init__(self) -> None:
        if self.prefill or self.decode:
            if self.prefill < 1 or self.decode < 1:
                raise InvalidParameterError(
                    "--prefill", "and --decode: a disaggregated cluster needs at least one "
                    "instance of each"
                )  # fmt: skip
        elif self.instances < 1:
            raise InvalidParameterError("--instances", "must be >= 1")
        if self.link_gbs <= 0 or self.link_latency_s < 0:
            raise InvalidParameterError("--link-gbs", "must be > 0 (and --link-latency-ms >= 0)")

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def num_instances(self) -> int:
        return self.prefill + self.decode if self.disaggregated else self.instances

    @property
    def label(self) -> str:
        if self.disaggregated:
            return f"{self.prefill}P:{self.decode}D"
        return f"{self.instances} colocated"


@dataclass
class SimulationResult:
    results: list[RequestResult]  # one per request, as `tandem bench serve` records them
    duration: float  # simulated seconds from the first arrival to the last finish
    num_steps: int  # over all instances
    busy_s: dict[str, float]  # simulated seconds stepping, per role (summed over instances)
    num_instances: dict[str, int]  # per role
    num_preemptions: int
    prefix_cache_hit_rate: float | None
    num_transfers: int = 0  # prompts whose K/V crossed the link
    transfer_s: float = 0.0  # their summed time on it, queueing included

    def utilization(self, role: str) -> float:
        """The mean share of the run an instance of ``role`` spent stepping."""
        return self.busy_s[role] / (self.duration * self.num_instances[role] or 1.0)


@dataclass
class _Node:
    """One simulated instance."""

    role: str  # "colocated", "prefill" or "decode"
    engine: Engine
    runner: SimulatedRunner
    route: Instance  # the router's view of it
    tracing: EngineTracing | None = None
    stepping: bool = False  # a step is running (its outputs arrive when it ends)
    link_free_at: float = 0.0  # decode: when its link finishes the pulls queued on it


def simulate(
    requests: list[BenchRequest],
    gaps: list[float],
    shape: ModelShape,
    cost: StepCostModel,
    config: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    vocab_size: int,
    trace: str | None = None,
    topology: Topology = Topology(),
) -> SimulationResult:
    """Run ``requests`` arriving after ``gaps`` (seconds after each send) through the
    ``topology``'s instances, each an engine with ``config``'s scheduler settings and
    ``num_blocks`` of KV cache, on simulated time. ``trace``: the step trace, one file
    per instance when there are several (``<stem>.<instance>.json``).

    A discrete-event loop: an arrival is routed and queued at its time (plus the cost
    model's ``frontend_s``, as every call to an instance, and its output's way back); an idle
    instance with work starts a step (after every event of the same instant), whose
    outputs are delivered when the cost model says it ends; a prefill instance's
    finished prompt goes to a decode instance, whose pull ends after the link's time.
    """
    sim_clock = SimulatedClock()
    arrivals = list(itertools.accumulate([0.0, *gaps[:-1]]))
    events: list = []  # (time, order, sequence, action): order 0 runs before 1 (steps)
    sequence = itertools.count()

    def at(time: float, action, order: int = 0) -> None:
        heapq.heappush(events, (time, order, next(sequence), action))

    finished: dict[int, RequestOutput] = {}
    transfers = {"count": 0, "seconds": 0.0}

    with clock.simulated(sim_clock):
        roles = (
            [("prefill", topology.prefill), ("decode", topology.decode)]
            if topology.disaggregated
            else [("colocated", topology.instances)]
        )
        nodes: dict[str, list[_Node]] = {}
        for role, count in roles:
            nodes[role] = []
            for index in range(count):
                name = role if count == 1 and not topology.disaggregated else f"{role}{index}"
                runner = SimulatedRunner(
                    shape, cost, sim_clock, num_blocks, config.cache.block_size,
                    max_model_len, vocab_size,
                )  # fmt: skip
                node = _Node(role, Engine(config, runner), runner, Instance(name))
                if topology.disaggregated:
                    connector = SimulatedConnector(
                        name, num_blocks, config.cache.block_size,
                        on_pull=lambda request, tokens, node=node: pull(node, request, tokens),
                    )  # fmt: skip
                    node.engine.set_kv_connector(connector)
                if trace is not None:
                    node.tracing = EngineTracing(node.engine)
                    node.tracing.start()
                nodes[role].append(node)
        by_name = {node.route.url: node for group in nodes.values() for node in group}
        all_nodes = list(by_name.values())

        def pick(role: str) -> _Node:
            return by_name[least_busy([node.route for node in nodes[role]]).url]

        def wake(node: _Node) -> None:
            if not node.stepping and node.engine.has_unfinished_requests():
                node.stepping = True
                at(sim_clock.time, lambda: step(node), order=1)

        def step(node: _Node) -> None:
            outputs = node.engine.step()
            if not node.runner.last_step_ran:  # blocked: an arrival or a release wakes it
                node.stepping = False
                return
            at(sim_clock.time, lambda: step_ended(node, outputs))

        def step_ended(node: _Node, outputs: list[RequestOutput]) -> None:
            node.stepping = False
            for output in outputs:
                if output.finished:
                    node.route.in_flight -= 1
                    index = int(output.request_id)
                    if node.role == "prefill":  # the router's second call
                        hand_over = functools.partial(
                            send_to_decode, index, output.kv_transfer_params
                        )
                        at(sim_clock.time + cost.frontend_s, hand_over)
                    else:
                        finished[index] = output
            wake(node)

        def add(node: _Node, index: int, max_tokens: int, transfer: dict | None) -> None:
            node.route.in_flight += 1
            params = SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )  # fmt: skip
            node.engine.add_request(
                str(index), {"prompt_token_ids": requests[index].prompt_token_ids}, params,
                arrival_time=sim_clock.time, kv_transfer_params=transfer,
            )  # fmt: skip
            wake(node)

        def arrive(index: int) -> None:
            request = requests[index]
            if topology.disaggregated and (
                len(request.prompt_token_ids) >= max(topology.local_prefill_threshold, 2)
            ):
                node = pick("prefill")
                add(node, index, 1, {"do_remote_decode": True})
            else:
                role = "decode" if topology.disaggregated else "colocated"
                add(pick(role), index, request.output_len, None)

        def send_to_decode(index: int, transfer: dict | None) -> None:
            node = pick("decode")
            add(node, index, requests[index].output_len, transfer)
            if transfer is not None and str(index) not in node.engine.scheduler.waiting_for_remote:
                release(transfer)  # no room for the remote K/V: computed here instead

        def pull(node: _Node, request, num_tokens: int) -> None:
            start = max(sim_clock.time, node.link_free_at)
            node.link_free_at = start + transfer_seconds(
                num_tokens * shape.kv_bytes_per_token, topology.link_gbs,
                topology.link_latency_s,
            )  # fmt: skip
            transfers["count"] += 1
            transfers["seconds"] += node.link_free_at - sim_clock.time
            transfer = request.kv_transfer

            def pulled() -> None:
                node.engine.scheduler.connector.pulled(request.request_id)
                node.engine.poll_kv_transfers()
                release({"remote_engine_id": transfer.remote_engine_id,
                         "lease_id": transfer.lease_id})  # fmt: skip
                wake(node)

            at(node.link_free_at, pulled)

        def release(transfer: dict) -> None:
            source = by_name[transfer["remote_engine_id"]]
            source.engine.scheduler.connector.release(
                transfer["lease_id"], source.engine.kv_manager
            )
            wake(source)

        for index, arrival in enumerate(arrivals[: len(requests)]):
            at(arrival + cost.frontend_s, lambda index=index: arrive(index))
        while events:
            time, _, _, action = heapq.heappop(events)
            sim_clock.time = time
            action()
        if len(finished) < len(requests):
            raise TandemError(
                "the scheduler cannot run the remaining requests (too few KV blocks for "
                "one of them?)"
            )
        if trace is not None:
            for node in all_nodes:
                path = trace if len(all_nodes) == 1 else _instance_path(trace, node.route.url)
                node.tracing.stop(path)
    results = [_result(finished[i], arrivals[i]) for i in range(len(requests))]
    queries = sum(node.engine.kv_manager.prefix_cache_queries for node in all_nodes)
    hits = sum(node.engine.kv_manager.prefix_cache_hits for node in all_nodes)
    return SimulationResult(
        results,
        max(r.start_time + r.e2el for r in results) if results else 0.0,
        sum(node.runner.num_steps for node in all_nodes),
        {role: sum(n.runner.busy_s for n in group) for role, group in nodes.items()},
        {role: len(group) for role, group in nodes.items()},
        sum(o.metrics.num_preemptions for o in finished.values()),
        hits / queries if queries else None,
        transfers["count"],
        transfers["seconds"],
    )


def _instance_path(path: str, instance: str) -> str:
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.{instance}.{suffix}" if dot else f"{path}.{instance}"


def _result(output, arrival: float) -> RequestResult:
    """A finished request as `tandem bench serve`'s client would have timed it."""
    metrics = output.metrics
    times = metrics.token_times
    return RequestResult(
        success=True,
        start_time=arrival,
        ttft=times[0] - arrival,
        itl=[b - a for a, b in itertools.pairwise(times)],
        e2el=times[-1] - arrival,
        prompt_len=len(output.prompt_token_ids),
        output_len=len(output.outputs[0].token_ids),
        cached_tokens=output.num_cached_tokens,
    )
