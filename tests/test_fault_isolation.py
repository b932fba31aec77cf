"""One request's bad values fail that request alone: the others in the same steps
finish with exactly the tokens transformers gives them.

The door (InputProcessor) refuses every value known to break a step, so these tests
go around it, as a caller of ``Engine.add`` can: the poisoned requests are the issue's
reproducers (a stop token id past the vocabulary with min_tokens, a seed past 64 bits,
prompt ids past the vocabulary) and a failure while decoding text."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.input_processor import EngineRequest
from tandem.engine.output_processor import OutputProcessor
from tandem.errors import RequestFailedError
from tandem.sampling import RequestOutputKind
from tandem.serving.async_engine import AsyncEngine
from tests.hf_models import VOCAB_SIZE, reference_greedy

MAX_NEW = 8
PROMPT_LENS = [5, 17, 9]


@pytest.fixture(scope="module")
def llama(model_dirs):
    return model_dirs("llama")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(2, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(llama, prompts):
    return reference_greedy(llama[1], prompts, MAX_NEW)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **kwargs)


def unvalidated(request_id: str, prompt: list[int], fields: dict) -> EngineRequest:
    """A request as the door would never let it through (SamplingParams validates
    itself when made: the fields are set afterwards)."""
    params = SamplingParams()
    for name, value in fields.items():
        setattr(params, name, value)
    return EngineRequest(request_id, None, prompt, params, time.perf_counter())


POISONS = {
    "stop id past the vocabulary": (
        [5, 6, 7],
        dict(temperature=0, max_tokens=8, stop_token_ids=[99999], min_tokens=4),
    ),
    "seed past 64 bits": ([5, 6, 7], dict(temperature=1.0, max_tokens=8, seed=2**64)),
    "prompt id past the vocabulary": ([5, VOCAB_SIZE + 3, 7], dict(max_tokens=8)),
    "prompt id below zero, n = 2": ([5, -2], dict(temperature=1.0, max_tokens=8, n=2)),
}


def run_to_end(llm: LLM) -> dict:
    finished = {}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


@pytest.mark.parametrize("poison", list(POISONS))
def test_a_poisoned_request_fails_alone(llama, prompts, expected, poison):
    llm = LLM(str(llama[0]), num_blocks=64, block_size=4)
    engine = llm.engine
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"good-{i}", prompt, greedy())
    bad_prompt, bad_params = POISONS[poison]
    engine.add(unvalidated("poison", bad_prompt, bad_params))
    engine.add_request("good-2", prompts[2], greedy())  # after it, in the same steps
    finished = run_to_end(llm)

    bad = finished["poison"]
    assert bad.error and all(c.finish_reason == "error" for c in bad.outputs)
    assert len(bad.outputs) == bad_params.get("n", 1)
    for i, want in enumerate(expected):
        out = finished[f"good-{i}"]
        assert out.error is None
        assert out.outputs[0].token_ids == want
    engine.kv_manager.check_no_leaks()
    # The engine goes on serving.
    again = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(), use_tqdm=False)
    assert again[0].outputs[0].token_ids == expected[0]


def test_a_failure_while_decoding_text_fails_that_request_alone(
    llama, prompts, expected, monkeypatch
):
    take = OutputProcessor._take_tokens

    def failing(self, sample, tokens):
        if sample.request.request_id.startswith("poison"):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        take(self, sample, tokens)

    monkeypatch.setattr(OutputProcessor, "_take_tokens", failing)
    llm = LLM(str(llama[0]), num_blocks=64, block_size=4)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"good-{i}", prompt, greedy())
    llm.engine.add_request("poison", prompts[0], greedy(n=3))
    finished = run_to_end(llm)
    assert "UnicodeDecodeError" in finished["poison"].error
    assert [c.finish_reason for c in finished["poison"].outputs] == ["error"] * 3
    for i, want in enumerate(expected):
        assert finished[f"good-{i}"].outputs[0].token_ids == want
    llm.engine.kv_manager.check_no_leaks()


def test_a_poisoned_stream_fails_alone_beside_live_streams(llama, prompts, expected, monkeypatch):
    """The server's engine thread: the poisoned stream ends with RequestFailedError,
    the streams beside it receive every delta of their correct output."""
    llm = LLM(str(llama[0]), num_blocks=64, block_size=4)
    async_engine = AsyncEngine(llm.engine)
    process = async_engine.input_processor.process
    poison_prompt, poison_params = POISONS["stop id past the vocabulary"]

    def let_poison_through(request_id, prompt, params, *args, **kwargs):
        if request_id == "poison":
            fields = {**poison_params, "output_kind": params.output_kind}
            return unvalidated(request_id, poison_prompt, fields)
        return process(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(async_engine.input_processor, "process", let_poison_through)

    async def stream(request_id: str, prompt: list[int]):
        queue: asyncio.Queue = asyncio.Queue()
        params = greedy(output_kind=RequestOutputKind.DELTA)
        await async_engine.add_request(request_id, prompt, params, queue)
        tokens = []
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                return item
            tokens += item.outputs[0].token_ids
            if item.finished:
                return tokens

    async def main():
        return await asyncio.gather(
            *(stream(f"good-{i}", p) for i, p in enumerate(prompts)), stream("poison", [5])
        )

    try:
        *good, bad = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert isinstance(bad, RequestFailedError)
    assert good == expected
    llm.engine.kv_manager.check_no_leaks()
