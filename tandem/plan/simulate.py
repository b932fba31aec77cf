"""``tandem simulate``: the real engine (Scheduler, KV manager, output processor) on a
simulated clock, with a cost model in place of the model.

    workload (bench serve's generators, gamma arrivals)
      -> requests added when the simulated clock reaches their arrival
      -> Engine.step(): the real scheduler decides the batch; SimulatedRunner "runs" it:
         the step's duration comes from the StepCostModel, the clock moves by it, every
         request that samples gets one token (never EOS: lengths come from the workload)
      -> each finished request's timeline -> the same summary as `tandem bench serve`

Nothing is computed but the schedule, so thousands of requests take seconds. The
engine is the one that serves (engine.py with a runner it is given), so a change to
the scheduler changes the simulation too. What it cannot see: preemption costs beyond
the recomputed tokens, and host effects the cost model does not fit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tandem.bench.client import RequestResult
from tandem.bench.datasets import BenchRequest
from tandem.config import EngineConfig
from tandem.engine import clock
from tandem.engine.engine import Engine
from tandem.errors import TandemError
from tandem.plan.cost import ModelShape, StepCostModel, shares_of
from tandem.runner.info import RunnerInfo, RunnerOutput
from tandem.runner.sampler import SampledToken
from tandem.sampling import RequestOutputKind, SamplingParams
from tandem.spec_decode.stats import SpecDecodeStats


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


@dataclass
class SimulationResult:
    results: list[RequestResult]  # one per request, as `tandem bench serve` records them
    duration: float  # simulated seconds from the first arrival to the last finish
    num_steps: int
    busy_s: float  # simulated seconds the engine was stepping
    num_preemptions: int
    prefix_cache_hit_rate: float | None


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
) -> SimulationResult:
    """Run ``requests`` arriving after ``gaps`` (seconds after each send) through the
    engine with ``config``'s scheduler settings, on simulated time."""
    sim_clock = SimulatedClock()
    runner = SimulatedRunner(
        shape, cost, sim_clock, num_blocks, config.cache.block_size, max_model_len, vocab_size
    )
    arrivals = list(itertools.accumulate([0.0, *gaps[:-1]]))
    with clock.simulated(sim_clock):
        engine = Engine(config, runner=runner)
        if trace is not None:
            engine.start_trace()
        finished = {}
        added = 0
        while added < len(requests) or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests():
                sim_clock.time = max(sim_clock.time, arrivals[added])
            while added < len(requests) and arrivals[added] <= sim_clock.time:
                request = requests[added]
                params = SamplingParams(
                    temperature=0, max_tokens=request.output_len, ignore_eos=True,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )  # fmt: skip
                engine.add_request(
                    str(added), {"prompt_token_ids": request.prompt_token_ids}, params,
                    arrival_time=arrivals[added],
                )  # fmt: skip
                added += 1
            for output in engine.step():
                if output.finished:
                    finished[int(output.request_id)] = output
            if not runner.last_step_ran and engine.has_unfinished_requests():
                if added == len(requests):  # nothing will change: it would loop forever
                    raise TandemError(
                        "the scheduler cannot run the remaining requests (too few KV "
                        "blocks for one of them?)"
                    )
                sim_clock.time = max(sim_clock.time, arrivals[added])
        if trace is not None:
            engine.stop_trace(trace)
    results = [_result(finished[i], arrivals[i]) for i in range(len(requests))]
    kv = engine.kv_manager
    return SimulationResult(
        results,
        max(r.start_time + r.e2el for r in results) if results else 0.0,
        runner.num_steps,
        runner.busy_s,
        sum(o.metrics.num_preemptions for o in finished.values()),
        kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else None,
    )


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
