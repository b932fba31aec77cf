"""The scheduler: one token budget per step, no prefill or decode phases.

Every request has ``num_tokens`` (prompt + output so far) and ``num_computed_tokens``
(tokens whose K/V are cached). Each step hands out ``max_num_batched_tokens``:

1. running requests that are decoding, one token each (decode-first keeps
   inter-token latency flat);
2. running requests with more to run (a prompt, or a preempted request recomputing
   its tokens), a chunk each, the fewest tokens left first;
3. waiting requests, admitted in arrival order while budget, sequence slots
   (``max_num_seqs``) and blocks last; their first chunk may be partial. A request
   whose prompt starts with blocks in the prefix cache starts past them: a cache hit
   is just ``num_computed_tokens`` above zero.

With the ``prefill-first`` policy, a step that can start a waiting prompt runs prompts
only, whole, and every decode waits for them (the classic prefill-prioritising server).

When the block pool runs dry, the most recently admitted running request is preempted:
its blocks are freed and it returns to the front of the waiting queue, to recompute
its prompt and output so far when it resumes (identical output, since its tokens are
kept). No request is admitted in a step that had to preempt.

A hybrid model's request also holds a slot of the state cache while it runs
(state_slots.py): admission waits for a free one, and preemption gives it back.

A request whose prompt's K/V come from another instance (a KV connector,
kv_connector.py) waits aside, its blocks allocated, until they have arrived.

The scheduler holds no tensors, so a cost-model simulator can drive it as well; its
output is plain data, and a diff: a request is sent whole once (NewRequestData), then
only as token counts and new block ids (ScheduledRequest).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from tandem.config import SchedulerConfig, SpeculativeConfig
from tandem.engine import clock
from tandem.engine.kv_connector import KVConnector
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.spec_control import SpeculationControl
from tandem.engine.state_slots import StateSlots
from tandem.step import NewRequestData, SampledToken, ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
        on_finish: Callable[[Request], None] = lambda request: None,
        connector: KVConnector | None = None,
        whole_prompts: bool = False,
        state_slots: StateSlots | None = None,
    ) -> None:
        """``on_finish`` hears of every request that finishes (stop, length, abort);
        ``connector`` (engine/kv_connector.py) brings K/V from and keeps them for other
        instances. ``whole_prompts``: a prompt is never cut into chunks (an encoder's
        tokens attend to the tokens after them): it waits for a step with room for it
        all, or runs alone when it is longer than a step's budget. ``state_slots``: a
        hybrid model's (engine/state_slots.py): a request runs only while it holds one."""
        self.config = config
        self.state_slots = state_slots
        self.whole_prompts = whole_prompts
        self.on_finish = on_finish
        self.connector = connector
        # Requests whose prompt's first K/V are arriving: id -> (request, tokens).
        self.waiting_for_remote: dict[str, tuple[Request, int]] = {}
        self.speculative = speculative
        # Measured: whether speculating pays (engine/spec_control.py).
        self.spec_control = (
            SpeculationControl() if speculative is not None and speculative.adaptive else None
        )
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []

    # -- queue ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        remote = self.connector.num_remote_tokens(request) if self.connector else 0
        if remote and self.kv.allocate_slots(request, remote):
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
            self.waiting_for_remote[request.request_id] = (request, remote)
            self.connector.on_blocks_allocated(
                request, list(self.kv.block_table(request.request_id)), remote
            )
            return
        self.waiting.append(request)  # (no room for the remote K/V: computed here)

    def poll_transfers(self) -> list[Request]:
        """Take the connector's finished receives: a request whose K/V arrived waits to
        run from there; a failed one recomputes its prompt or fails. Returns the
        requests that failed (finished, aborted)."""
        failed = []
        for done in self.connector.finished_transfers() if self.connector else ():
            request, remote = self.waiting_for_remote.pop(done.request_id)
            if request.status.finished:  # aborted while its blocks were being written
                self.kv.free(request)
                continue
            request.status = RequestStatus.WAITING  # the receive is over
            if done.ok:
                request.num_computed_tokens = remote
            elif done.recompute:
                self.kv.free(request)
            else:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                failed.append(request)
                continue
            self.waiting.append(request)
        return failed

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work (requests whose K/V are arriving do not: the
        connector's wake-up runs ``poll_transfers``)."""
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string): free their blocks."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                self.waiting.remove(request)
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        # A request whose K/V are still arriving keeps its blocks (the sender writes into
        # them) until poll_transfers frees them; the runner never saw it.
        receiving = request.status == RequestStatus.WAITING_FOR_REMOTE_KV
        if self.state_slots is not None:
            self.state_slots.give_back(request.request_id)
        request.status = status
        request.timeline.finished = clock.now()
        if not receiving:
            keep = False
            if self.connector is not None:
                table = list(self.kv.block_table(request.request_id))
                keep, request.kv_transfer_output = self.connector.request_finished(request, table)
            if keep:
                self.kv.detach(request)  # the connector releases them
            else:
                self.kv.free(request)
            self._finished_ids.append(request.request_id)
        del self.requests[request.request_id]
        if self.spec_control is not None:
            self.spec_control.forget(request.request_id)
        self.on_finish(request)

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids, started_at=clock.now())
        self._finished_ids = []
        if self.spec_control is not None:
            self.spec_control.step_speculates(len(self.running))
        if self.config.scheduling_policy == "prefill-first":
            # Prompts run whole, alone. Only when none can start (no blocks or sequence
            # slots) do the decodes run, and they are what frees blocks for the prompts.
            self._admit_waiting(out, whole=True)
            if not out.scheduled:
                self._schedule_running(out)
            return out
        self._schedule_running(out)
        if not out.preempted_ids:
            self._admit_waiting(out, whole=False)
        return out

    def _budget_left(self, out: SchedulerOutput) -> int:
        # Derived from what is scheduled, so a victim preempted after it was scheduled
        # in this step gives its tokens back.
        return self.config.max_num_batched_tokens - out.num_batched_tokens

    def _schedule_running(self, out: SchedulerOutput) -> None:
        # Decodes (one token to run) first, then requests with a chunk to run: prompts,
        # and preempted requests recomputing their prompt and output.
        for request in sorted(self.running, key=self._tokens_left):
            budget = self._budget_left(out)
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk_size(request, budget, whole=False)
            num_spec = self._num_spec_tokens(request, num_new, budget)
            if not self._allocate_or_preempt(request, num_new + num_spec, out):
                continue  # the request preempted itself
            out.add(self._scheduled(request, num_new, num_spec))

    @staticmethod
    def _tokens_left(request: Request) -> int:
        return request.num_tokens - request.num_computed_tokens

    def _chunk_size(self, request: Request, budget: int, whole: bool) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if whole:
            # prefill-first runs a prompt whole, even when it alone exceeds the budget
            # of an otherwise empty step (it would never run otherwise).
            fits = remaining <= budget or budget == self.config.max_num_batched_tokens
            return remaining if fits else 0
        cap = self.config.long_prefill_token_threshold
        if cap and remaining > 1:
            remaining = min(remaining, cap)
        return min(remaining, budget)

    def _num_spec_tokens(self, request: Request, num_new: int, budget: int) -> int:
        """Draft slots for a decoding request: k, or fewer near max_tokens, the context
        end or the budget; none while the batch is at least ``disable_by_batch_size``,
        or where speculating was measured not to pay (spec_control.py)."""
        spec = self.speculative
        if spec is None or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        if spec.disable_by_batch_size is not None and len(self.running) >= (
            spec.disable_by_batch_size
        ):
            return 0
        control = self.spec_control
        if control is not None and not control.request_speculates(
            request.request_id, len(self.running)
        ):
            return 0
        # Accepting k drafts adds k + 1 tokens, all of which must fit.
        room = self.max_model_len - request.num_tokens - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(0, min(spec.num_speculative_tokens, room, budget - 1))

    def _scheduled(self, request: Request, num_new: int, num_spec: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        table = self.kv.block_table(request.request_id)
        # Blocks the runner has not been sent (``update`` lowers the count when it frees
        # blocks that held only rejected drafts).
        sent = request.num_blocks_sent
        request.num_blocks_sent = len(table)
        return ScheduledRequest(
            request.request_id,
            start,
            num_new,
            start + num_new == request.num_tokens,
            num_spec,
            sent,
            tuple(table[sent:]),
        )

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        if self.state_slots is not None:
            self.state_slots.give_back(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_blocks_sent = 0  # the runner forgets it; resuming sends it anew
        request.timeline.preemption_times.append(clock.now())
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)
        # A victim already given tokens in this step loses them.
        out.remove(request.request_id)

    def _admit_waiting(self, out: SchedulerOutput, whole: bool) -> None:
        while (
            self.waiting
            and self._budget_left(out) > 0
            and len(self.running) < self.config.max_num_seqs
            and (self.state_slots is None or self.state_slots.num_free > 0)
        ):
            request = self.waiting[0]
            # A prefix cache hit starts the request past the tokens found there. (A request
            # whose K/V came from another instance starts past them already; one that
            # wants its prompt's logprobs, or an embedding of it, computes every token.)
            base = request.num_computed_tokens
            params = request.sampling_params
            scores_prompt = params.prompt_logprobs is not None or params.pooling is not None
            cached = [] if base or scores_prompt else self.kv.find_cached_prefix(request)
            request.num_computed_tokens = base or len(cached) * self.kv.block_size
            num_new = self._chunk_size(request, self._budget_left(out), whole or self.whole_prompts)
            if num_new == 0 or not self.kv.allocate_slots(request, num_new, cached):
                request.num_computed_tokens = base
                break
            self.waiting.popleft()
            num_cached = len(cached) * self.kv.block_size
            self.kv.record_admission(request, num_cached)
            if request.timeline.first_scheduled is None:
                request.timeline.first_scheduled = out.started_at
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if self.state_slots is not None:
                self.state_slots.take(request.request_id)
            request.num_blocks_sent = 0
            out.add(self._scheduled(request, num_new), self._new_request_data(request))

    def _new_request_data(self, request: Request) -> NewRequestData:
        slots = self.state_slots
        return NewRequestData(
            request.request_id,
            request.prompt_token_ids,
            list(request.output_token_ids),
            request.sampling_params,
            (*request.eos_token_ids, *request.stop_token_ids),
            request.grammar,
            request.cache_salt,
            -1 if slots is None else slots.slot_of(request.request_id),
        )

    def update(
        self,
        out: SchedulerOutput,
        sampled: Mapping[str, Sequence[SampledToken]],
        failed: Mapping[str, str] | None = None,
        drafted: Mapping[str, int] | None = None,
        pooled: Mapping[str, list[float]] | None = None,
    ) -> list[tuple[Request, list[SampledToken]]]:
        """Advance each scheduled request by the tokens whose K/V it now has, append its
        new tokens (several when drafts were accepted) up to the first stop condition,
        and finish requests that stop (``drafted``: the draft tokens each speculating
        request had verified, for the speculation control). Returns each request that
        received tokens, with the tokens it kept; then each request in ``failed`` (id ->
        why: the runner could not run or sample it) with no tokens, finished as
        FINISHED_ERROR. A failed request's K/V from this step is never cached.
        ``pooled``: embedding requests whose prompt is done (id -> vector): each keeps its
        vector and finishes, with no tokens."""
        now = clock.now()
        updated = []
        failed = failed or {}
        for item in out.scheduled:
            request = self.requests[item.request_id]
            if item.request_id in failed:
                continue
            tokens = list(sampled.get(item.request_id, ()))
            if item.num_spec_tokens and tokens:
                # K/V is valid for the last token and the accepted drafts; the slots of
                # rejected drafts are given back (blocks holding only those are freed).
                request.num_computed_tokens += len(tokens)
            else:
                request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_computed_blocks(request)
            if pooled and item.request_id in pooled:
                request.pooled = pooled[item.request_id]
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                updated.append((request, []))
                continue
            if not tokens:
                continue
            kept = []
            for token in tokens:
                request.append_output_token(token.token_id, now)
                kept.append(token)
                status = request.check_stop(self.max_model_len)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    break
            else:
                if item.num_spec_tokens:
                    self.kv.trim(request)
                    # Blocks freed here may come back with other ids: resend from there.
                    table_len = len(self.kv.block_table(request.request_id))
                    request.num_blocks_sent = min(request.num_blocks_sent, table_len)
            updated.append((request, kept))
        for request_id, why in failed.items():
            request = self.requests.get(request_id)
            if request is not None and not request.status.finished:
                request.error = why
                self.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
                updated.append((request, []))
        if self.spec_control is not None and out.scheduled:
            self.spec_control.observe(
                len(out.scheduled),
                drafted or {},
                sampled,
                now - out.started_at,
                all(i.num_new_tokens == 1 for i in out.scheduled),
            )
        return updated
