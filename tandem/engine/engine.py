"""Engine: add_request / step / abort. The wiring of one engine instance:

    InputProcessor   prompt + params -> validated EngineRequest (before any queue)
    Scheduler        token budget per step; KVCacheManager for blocks and prefix hits
    executor         runs each step's forward (tandem/step.py's Executor: a worker in
                     this process, tensor-parallel ranks, or a simulated one); the engine
                     is handed it and never imports torch or model code
    OutputProcessor  tokens -> RequestOutputs: n > 1 fan-out, text, logprobs, stop
                     strings, output kinds

``step`` is schedule, execute, update, then the output processor.
"""

from __future__ import annotations

from typing import Any

from tandem.config import EngineConfig
from tandem.engine.input_processor import EngineRequest, InputProcessor, PromptInput
from tandem.engine.kv_connector import KVConnector
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.observer import EngineObserver, StepStats
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler
from tandem.engine.state_slots import StateSlots
from tandem.errors import InvalidParameterError
from tandem.outputs import RequestOutput
from tandem.sampling import SamplingParams
from tandem.step import Executor, SchedulerOutput, SpecDecodeStats

__all__ = ["Engine", "PromptInput"]


class Engine:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        """``executor``: whoever runs the model (tandem/step.py's protocol), built by the
        caller: ``tandem.executor.make_executor(config)`` for the one ``config`` asks
        for, or a cost model's stand-in (tandem simulate)."""
        self.config = config
        self.executor = executor
        self.model_info = info = executor.info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        # (an encoder's blocks hold nothing to reuse: its K/V are never cached; a
        # hybrid's K/V do not make a state: engine/state_slots.py)
        hybrid = info.num_state_slots > 0
        self.kv_manager = KVCacheManager(
            info.num_blocks,
            info.block_size,
            config.cache.enable_prefix_caching and not info.encoder and not hybrid,
        )
        self.state_slots = StateSlots(info.num_state_slots) if hybrid else None
        self.observers: list[EngineObserver] = []
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_manager,
            self.max_model_len,
            config.speculative,
            on_finish=self._notify_finished,
            whole_prompts=info.encoder,
            state_slots=self.state_slots,
        )
        self.input_processor = InputProcessor.of(info)
        self.output_processor = OutputProcessor(
            info.tokenizer, self._stop_at_string, self._fail_child
        )

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.executor.spec_stats

    # -- observers ---------------------------------------------------------------------

    def add_observer(self, observer: EngineObserver) -> None:
        self.observers.append(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        self.observers.remove(observer)

    def stats(self, out: SchedulerOutput | None = None, num_generated: int = 0) -> StepStats:
        """A snapshot of the engine's gauges and counters (``out``: the step just run)."""
        kv, connector = self.kv_manager, self.scheduler.connector
        control = self.scheduler.spec_control
        return StepStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_in_use=kv.num_blocks_in_use,
            kv_usage=kv.usage,
            num_batched_tokens=out.num_batched_tokens if out else 0,
            num_generated_tokens=num_generated,
            num_preempted=len(out.preempted_ids) if out else 0,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_kv_leases=connector.num_leases if connector else 0,
            num_lease_expiries=connector.num_lease_expiries if connector else 0,
            spec=self.spec_stats.copy() if self.config.speculative else None,
            num_speculating=sum(1 for i in out.scheduled if i.num_spec_tokens) if out else 0,
            spec_switches=control.num_switches if control else 0,
            expert_load=self._expert_load() if out else (),
        )

    def _expert_load(self) -> tuple[tuple[int, ...], ...]:
        load = getattr(self.executor, "expert_load", None)  # (a mixture's)
        return load() if load is not None else ()

    def notify_changed(self) -> None:
        """Tell the observers that state changed between steps (leases, aborts)."""
        if self.observers:
            stats = self.stats()
            for observer in self.observers:
                observer.step_done(None, stats)

    def _notify_finished(self, request: Request) -> None:
        for observer in self.observers:
            observer.request_finished(request)

    # -- requests --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[int]:
        """Validate (InputProcessor) and queue; on a bad request raise before anything
        is queued. Returns the prompt's token ids. See ``add``."""
        request = self.input_processor.process(
            request_id, prompt, params, arrival_time, kv_transfer_params
        )
        self.add(request)
        return request.prompt_token_ids

    def add(self, request: EngineRequest) -> None:
        """Queue a processed request: n child requests, scheduled independently.

        Its ``kv_transfer`` goes to the KV connector, if one is set (disaggregated
        serving: ``set_kv_connector``); n > 1 computes its prompt here (the children
        could not share one transfer)."""
        if request.request_id in self.output_processor:
            raise InvalidParameterError("request_id", f"{request.request_id!r} is already in use")
        params, transfer = request.params, request.kv_transfer
        children = []
        for index in range(params.n):
            child_params = params.for_child(index) if params.n > 1 else params
            child_id = request.request_id if params.n == 1 else f"{request.request_id}-{index}"
            children.append(
                Request(
                    child_id,
                    request.prompt_token_ids,
                    child_params,
                    self.model_info.eos_token_ids,
                    request.arrival_time,
                    request.cache_salt,
                )
            )
        for index, child in enumerate(children):
            child.parent_id, child.sample_index, child.num_samples = (
                request.request_id,
                index,
                params.n,
            )
            child.grammar = request.grammar
        self.output_processor.add_request(request, children)
        for child in children:
            if params.n == 1:
                child.kv_transfer = transfer
            for observer in self.observers:
                observer.request_added(child)
            self.scheduler.add_request(child)

    def set_kv_connector(self, connector: KVConnector) -> None:
        """Disaggregated serving: hand requests' K/V to and from other instances."""
        if self.state_slots is not None:
            raise InvalidParameterError(
                "kv_transfer_config",
                "a hybrid model's recurrent state is not moved between instances: "
                "disaggregated serving takes attention-only models",
            )
        self.scheduler.connector = connector

    def poll_kv_transfers(self) -> list[str]:
        """Let requests whose K/V arrived run (the connector calls this when a receive
        ends). Returns the ids of requests that failed for good (their receive failed
        and recomputing was not allowed)."""
        failed = []
        for request in self.scheduler.poll_transfers():
            failed.append(request.request_id)
            self.output_processor.forget(request.request_id)
        return failed

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for request_id in ids:
            children = self.output_processor.children(request_id)
            if not children:
                continue
            self.scheduler.finish_requests(
                [c.request_id for c in children], RequestStatus.FINISHED_ABORTED
            )
            self.output_processor.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step. A request whose own values make the runner or the output processor
        raise fails alone (its output has ``error``); only a failure of the shared
        forward pass raises here, and then every request in the step is lost."""
        scheduler_output = self.scheduler.schedule()
        result = self.executor.execute(scheduler_output)
        for request_id, (first, scored) in result.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(request_id, first, scored)
        updated = self.scheduler.update(
            scheduler_output, result.sampled, result.failed, result.drafted, result.pooled
        )
        outputs = self.output_processor.process(updated)
        if self.observers:
            stats = self.stats(scheduler_output, sum(len(tokens) for _, tokens in updated))
            for observer in self.observers:
                observer.step_done(scheduler_output, stats)
        return outputs

    def _fail_child(self, request: Request, why: str) -> None:
        request.error = why
        if request.status.finished:  # it had just finished when its output failed
            request.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)

    def _stop_at_string(self, request: Request, stop: str, num_after: int) -> None:
        """A stop string ended in a token; tokens accepted after it in the same step
        (speculation) are dropped, as if the request had stopped there."""
        request.stop_reason = stop
        if num_after:
            request.drop_last_output_tokens(num_after)
        if request.status.finished:  # a later token also hit max_tokens or EOS
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
