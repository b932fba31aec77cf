"""Output kinds (CUMULATIVE, DELTA, FINAL_ONLY): the same request reported three ways
must tell the same story; and the engine's observer events."""

from __future__ import annotations

import dataclasses

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.observer import EngineObserver
from tandem.engine.request import RequestStatus
from tandem.sampling import RequestOutputKind

PROMPT = "import os\nimport sys\n\n\ndef main("


@pytest.fixture(scope="module")
def llm():
    return LLM("stdlib-lm")


def outputs_of(llm: LLM, params: SamplingParams, kind: RequestOutputKind):
    engine = llm.engine
    engine.add_request(f"kind-{kind.name}", PROMPT, dataclasses.replace(params, output_kind=kind))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, stop="\n\n", logprobs=2),
        SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=20, stop=["):"], logprobs=1),
    ],
    ids=["greedy-stop-string", "n3-sampled"],
)
def test_delta_and_final_only_agree_with_cumulative(llm, params):
    cumulative = outputs_of(llm, params, RequestOutputKind.CUMULATIVE)
    deltas = outputs_of(llm, params, RequestOutputKind.DELTA)
    final_only = outputs_of(llm, params, RequestOutputKind.FINAL_ONLY)
    expected = cumulative[-1]
    assert expected.finished and len(final_only) == 1 and final_only[0].finished
    joined: dict[int, dict] = {}
    for output in deltas:
        for c in output.outputs:
            entry = joined.setdefault(c.index, {"text": "", "tokens": [], "logprobs": []})
            entry["text"] += c.text
            entry["tokens"] += c.token_ids
            entry["logprobs"] += c.logprobs or []
            entry["finish"] = c.finish_reason
    assert deltas[-1].finished
    for want, final in zip(expected.outputs, final_only[0].outputs, strict=True):
        got = joined[want.index]
        assert (got["text"], got["tokens"], got["finish"]) == (
            want.text, want.token_ids, want.finish_reason
        )  # fmt: skip
        assert got["logprobs"] == want.logprobs
        assert (final.text, final.token_ids, final.finish_reason) == (
            want.text, want.token_ids, want.finish_reason
        )  # fmt: skip
    llm.engine.kv_manager.check_no_leaks()


def test_stream_yields_deltas_and_aborts_when_dropped(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    pieces = list(llm.stream(PROMPT, params))
    whole = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert "".join(p.outputs[0].text for p in pieces) == whole.text
    assert sum(len(p.outputs[0].token_ids) for p in pieces) == 12
    stream = llm.stream(PROMPT, params)
    next(stream)
    stream.close()  # the consumer walked away: the request is aborted, nothing leaks
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv_manager.check_no_leaks()


class Recorder(EngineObserver):
    def __init__(self) -> None:
        self.added, self.finished, self.generated, self.steps = [], [], 0, 0

    def request_added(self, request):
        self.added.append(request.request_id)

    def request_finished(self, request):
        self.finished.append((request.request_id, request.status))

    def step_done(self, out, stats):
        self.steps += out is not None
        self.generated += stats.num_generated_tokens


def test_observer_sees_every_request_and_token(llm):
    recorder = Recorder()
    engine = llm.engine
    engine.add_observer(recorder)
    try:
        params = SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True)
        outputs = llm.generate([PROMPT, "def f("], params, use_tqdm=False)
        engine.add_request("to-abort", PROMPT, params)
        engine.abort("to-abort")
    finally:
        engine.remove_observer(recorder)
    assert sorted(recorder.added) == sorted(
        [f"{o.request_id}-{i}" for o in outputs for i in range(2)] + ["to-abort-0", "to-abort-1"]
    )
    statuses = dict(recorder.finished)
    assert statuses["to-abort-0"] == statuses["to-abort-1"] == RequestStatus.FINISHED_ABORTED
    assert sum(s == RequestStatus.FINISHED_LENGTH for s in statuses.values()) == 4
    assert recorder.generated == 4 * 5 and recorder.steps >= 5
