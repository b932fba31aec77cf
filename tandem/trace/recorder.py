"""StepTracer: what every engine step did, and each request's life, as a Chrome
trace-event file (opens in Perfetto, ui.perfetto.dev, or chrome://tracing).

Tracks::

    engine / steps          one slice per step: batch size, tokens (prefill, decode),
                            KV blocks in use, preemptions; counters for blocks and tokens
    requests / <id>         one lane per request: waiting, prefill [a, b) chunks, decode
                            steps, preempted; instants for arrival, first token (TTFT),
                            finish (reason)

A trace left running stays bounded: past ``max_events`` the oldest finished requests'
lanes, then the oldest steps, are dropped (the trace says how many), and a finished
lane keeps no reference to its request.

The tracer is an EngineObserver (``EngineTracing.start`` attaches one): it hears of
requests being queued and aborted and of every step; everything else is read from the
step's SchedulerOutput and the requests' own timelines, so the trace and the request
metrics come from the same clock readings.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine import clock
from tandem.engine.observer import EngineObserver, StepStats, load_summary
from tandem.engine.request import Request, RequestStatus
from tandem.step import SchedulerOutput

ENGINE_PID, REQUESTS_PID = 0, 1


DEFAULT_MAX_EVENTS = 500_000  # roughly 150 MB of Python objects at most
EVENTS_PER_STEP = 3  # a step's slice and its two counters


@dataclass
class _Lane:
    request: Request | None  # None once finished (the trace keeps only its events)
    tid: int
    state: str = "waiting"  # waiting | running | preempted | finished
    state_since: float = 0.0
    first_token_marked: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)


class StepTracer(EngineObserver):
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.origin = clock.now()
        self.max_events = max_events
        self.steps: deque[dict[str, Any]] = deque()
        self.lanes: dict[str, _Lane] = {}
        self.num_events = 0
        self.num_dropped_requests = self.num_dropped_steps = 0
        self._next_tid = 1

    def _count(self, events: int) -> None:
        self.num_events += events
        if self.num_events > self.max_events:
            self._drop_oldest(target=self.max_events * 9 // 10)

    def _drop_oldest(self, target: int) -> None:
        """Drop the oldest finished lanes, then the oldest steps, until ``target``."""
        for request_id in [rid for rid, lane in self.lanes.items() if lane.state == "finished"]:
            if self.num_events <= target:
                return
            self.num_events -= len(self.lanes.pop(request_id).events)
            self.num_dropped_requests += 1
        while self.num_events > target and self.steps:
            self.steps.popleft()
            self.num_events -= EVENTS_PER_STEP
            self.num_dropped_steps += 1

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def _slice(self, lane: _Lane, name: str, category: str, start: float, end: float, **args):
        lane.events.append(
            {"name": name, "cat": category, "ph": "X", "ts": self._us(start),
             "dur": round((end - start) * 1e6, 3), "pid": REQUESTS_PID, "tid": lane.tid,
             "args": args}
        )  # fmt: skip
        self._count(1)

    def _instant(self, lane: _Lane, name: str, t: float, **args) -> None:
        lane.events.append(
            {"name": name, "cat": "lifecycle", "ph": "i", "s": "t", "ts": self._us(t),
             "pid": REQUESTS_PID, "tid": lane.tid, "args": args}
        )  # fmt: skip
        self._count(1)

    # -- EngineObserver ----------------------------------------------------------------

    def request_added(self, request: Request) -> None:
        lane = _Lane(request, tid=self._next_tid, state_since=request.timeline.arrival)
        self._next_tid += 1
        self.lanes[request.request_id] = lane
        self._instant(lane, "arrival", request.timeline.arrival, prompt_tokens=request.num_tokens)

    def step_done(self, out: SchedulerOutput | None, stats: StepStats) -> None:
        if out is None:
            return
        start, end = out.started_at, clock.now()
        prefill_tokens = decode_tokens = 0
        for victim_id in out.preempted_ids:
            lane = self.lanes.get(victim_id)
            if lane is not None:
                lane.state, lane.state_since = "preempted", start
        for item in out.scheduled:
            lane = self.lanes.get(item.request_id)
            first, last = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            if lane is None:  # queued before tracing began: not drawn; one token = decode
                prefill_tokens += item.num_new_tokens if item.num_new_tokens > 1 else 0
                decode_tokens += item.num_new_tokens == 1
                continue
            request = lane.request
            is_decode = item.num_new_tokens == 1 and first >= len(request.prompt_token_ids)
            if is_decode:
                decode_tokens += 1
            else:
                prefill_tokens += item.num_new_tokens
            if lane.state in ("waiting", "preempted"):
                self._slice(lane, lane.state, lane.state, lane.state_since, start)
                lane.state = "running"
            if is_decode:
                self._slice(lane, "decode", "decode", start, end, position=first)
            else:
                # Past the prompt, a chunk recomputes a preempted request's output too.
                name = "prefill" if last <= len(request.prompt_token_ids) else "recompute"
                self._slice(
                    lane, f"{name} [{first}, {last})", "prefill", start, end,
                    tokens=item.num_new_tokens,
                )  # fmt: skip
            times = request.timeline.token_times
            if times and not lane.first_token_marked:
                ttft = times[0] - request.timeline.arrival
                self._instant(lane, "first token", times[0], ttft_ms=round(ttft * 1e3, 3))
                lane.first_token_marked = True
            if request.status.finished:
                self._finish(lane)
        self.steps.append(
            {"start": start, "end": end, "batch_size": len(out.scheduled),
             "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens,
             "kv_blocks_used": stats.kv_blocks_in_use,
             "preempted": list(out.preempted_ids),
             "speculating": stats.num_speculating,
             # (new tokens with speculative slots, tokens already cached) per request:
             # what the step cost model needs (tandem plan --calibrate --from-trace)
             "shares": [[i.num_new_tokens + i.num_spec_tokens, i.num_computed_tokens]
                        for i in out.scheduled]}
        )  # fmt: skip
        if stats.expert_load:  # a mixture: how many experts the step read, how evenly
            self.steps[-1].update(load_summary(stats.expert_load))
        self._count(EVENTS_PER_STEP)

    def request_finished(self, request: Request) -> None:
        # A request that finishes in a step is drawn by step_done; an abort (or a
        # failure outside the step) ends its lane here.
        if request.status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return
        lane = self.lanes.get(request.request_id)
        if lane is not None and lane.state != "finished":
            if lane.state in ("waiting", "preempted"):
                end = request.timeline.finished or clock.now()
                self._slice(lane, lane.state, lane.state, lane.state_since, end)
            self._finish(lane)

    def _finish(self, lane: _Lane) -> None:
        request, lane.request = lane.request, None
        lane.state = "finished"
        self._instant(
            lane, "finished", request.timeline.finished or clock.now(),
            reason=request.finish_reason, output_tokens=request.num_output_tokens,
        )  # fmt: skip

    # -- output --------------------------------------------------------------------------

    def chrome_trace(self) -> dict[str, Any]:
        events: list[dict[str, Any]] = [
            _meta("process_name", ENGINE_PID, 0, {"name": "engine"}),
            _meta("thread_name", ENGINE_PID, 0, {"name": "steps"}),
            _meta("process_name", REQUESTS_PID, 0, {"name": "requests"}),
        ]
        for index, step in enumerate(self.steps, start=self.num_dropped_steps):
            ts = self._us(step["start"])
            args = {k: v for k, v in step.items() if k not in ("start", "end")}
            events.append(
                {"name": f"step {index}", "cat": "step", "ph": "X", "ts": ts,
                 "dur": round((step["end"] - step["start"]) * 1e6, 3), "pid": ENGINE_PID,
                 "tid": 0, "args": args}
            )  # fmt: skip
            events.append(
                {"name": "KV blocks in use", "ph": "C", "ts": ts, "pid": ENGINE_PID,
                 "args": {"blocks": step["kv_blocks_used"]}}
            )  # fmt: skip
            events.append(
                {"name": "tokens per step", "ph": "C", "ts": ts, "pid": ENGINE_PID,
                 "args": {"prefill": step["prefill_tokens"], "decode": step["decode_tokens"]}}
            )  # fmt: skip
        for request_id, lane in self.lanes.items():
            events.append(_meta("thread_name", REQUESTS_PID, lane.tid, {"name": request_id}))
            events.append(
                _meta("thread_sort_index", REQUESTS_PID, lane.tid, {"sort_index": lane.tid})
            )
            events.extend(lane.events)
        dropped = {"requests": self.num_dropped_requests, "steps": self.num_dropped_steps}
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"dropped": dropped}}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path


def _meta(kind: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


class EngineTracing:
    """Switches one engine's step trace on and off: its owner (LLM, a served engine,
    the in-process server client) keeps one, so the engine itself knows no tracer."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tracer: StepTracer | None = None

    def start(self) -> None:
        """Record every step from now on (requests already queued are not drawn)."""
        if self.tracer is None:
            self.tracer = StepTracer()
            self.engine.add_observer(self.tracer)

    def stop(self, path: str | Path | None = None) -> StepTracer | None:
        """Stop recording; write the Chrome trace to ``path`` if given."""
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            self.engine.remove_observer(tracer)
            if path is not None:
                tracer.write(path)
        return tracer
