"""A thinking budget the engine enforces (SamplingParams.thinking, runner/thinking.py):
at the budget the end of the thinking is forced token by token and the answer
follows, checked against the exact math (the same greedy model continued from the
forced tokens); a constraint holds the answer only; speculation and preemption
change nothing."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.errors import InvalidParameterError
from tandem.runner.thinking import ThinkingGate
from tandem.sampling import StructuredOutputsParams, ThinkingParams

END = (40, 41, 42)  # a three-token end of thinking


def test_the_gate_counts_finds_the_end_and_forces_it_token_by_token():
    gate = ThinkingGate(ThinkingParams(END, budget=4))
    assert gate.advance([1, 2, 40]) == [] and gate.forced() is None
    assert gate.advance([3]) == [] and gate.count == 4
    assert gate.forced() == 40  # the budget is spent: the end, from its first token
    gate.advance([40])
    assert gate.forced() == 41
    gate.advance([41])
    assert gate.forced() == 42
    assert gate.advance([42, 7, 8]) == [7, 8]  # the end ends it: the rest is the answer
    assert gate.done and gate.forced() is None and gate.advance([9]) == [9]


def test_the_end_written_before_the_budget_ends_the_thinking():
    gate = ThinkingGate(ThinkingParams(END, budget=100))
    assert gate.advance([5, 40, 41, 40, 41, 42, 6]) == [6] and gate.done
    single = ThinkingGate(ThinkingParams((9,), budget=0))
    assert single.forced() == 9  # a zero budget: the end comes first
    assert single.advance([9, 1]) == [1]


def test_a_part_of_the_end_written_at_the_budget_is_finished_not_restarted():
    gate = ThinkingGate(ThinkingParams(END, budget=3))
    gate.advance([1, 2, 40])
    assert gate.forced() == 41


def test_drafts_stop_below_the_budget_and_before_a_constrained_answer():
    gate = ThinkingGate(ThinkingParams(END, budget=6))
    gate.advance([1, 2])
    # Positions 2..6 would sample at counts 2..5 (< 6): four drafts at most.
    assert gate.drafts_allowed([7, 7, 7, 7, 7, 7], constrained=False) == 3
    assert gate.drafts_allowed([7, 42, 7], constrained=True) == 1  # may end: cut there
    assert gate.drafts_allowed([7, 42, 7], constrained=False) == 3
    unbounded = ThinkingGate(ThinkingParams(END))
    assert unbounded.drafts_allowed([7] * 9, constrained=False) == 9


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"end_token_ids": ()}, "thinking"), ({"end_token_ids": (-1,)}, "thinking"),
     ({"end_token_ids": (1,), "budget": -1}, "thinking_budget"),
     ({"end_token_ids": (1,), "budget": 1.5}, "thinking_budget")],
)  # fmt: skip
def test_bad_thinking_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(InvalidParameterError) as refused:
        ThinkingParams(**kwargs)
    assert refused.value.param == field


# -- in the engine -------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6, 7], [9, 8] * 6, [3, 4, 3, 4, 3], [11] * 7]


def _greedy(llm: LLM, prompts, max_tokens: int, **extra) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def tiny(model_dirs):
    return LLM(str(model_dirs("llama")[0]))


def test_at_the_budget_the_end_is_forced_and_the_answer_follows(tiny):
    budget, total = 3, 10
    thinking = ThinkingParams(END, budget)
    got = _greedy(tiny, PROMPTS, total, thinking=thinking)
    free = _greedy(tiny, PROMPTS, budget)  # what the model thinks, unforced
    after = _greedy(tiny, [p + f + list(END) for p, f in zip(PROMPTS, free, strict=True)],
                    total - budget - len(END))  # fmt: skip
    assert got == [f + list(END) + a for f, a in zip(free, after, strict=True)]


def test_a_constraint_holds_the_answer_only(tiny):
    choices = ["yes", "no", "maybe"]
    params = SamplingParams(
        temperature=0, max_tokens=20, thinking=ThinkingParams(END, 4),
        structured_outputs=StructuredOutputsParams(choice=choices),
    )  # fmt: skip
    outputs = tiny.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    free = _greedy(tiny, PROMPTS, 4)
    tokenizer = tiny.get_tokenizer()
    for output, thought in zip(outputs, free, strict=True):
        ids = list(output.outputs[0].token_ids)
        assert ids[:4] == thought and tuple(ids[4:7]) == END  # the thinking ran free
        assert tokenizer.decode(ids[7:], True) in choices  # the answer held to the choice
        assert output.outputs[0].finish_reason == "stop"


def test_speculation_and_preemption_under_a_budget_are_lossless(model_dirs):
    folder = str(model_dirs("llama")[0])
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, thinking=ThinkingParams(END, 7),
        structured_outputs=StructuredOutputsParams(regex="(ab|b){1,8}"),
    )  # fmt: skip
    prompts = [{"prompt_token_ids": p * 3} for p in PROMPTS]
    plain = LLM(folder).generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    speculating = LLM(folder, speculative_config=spec)
    drafted = speculating.generate(prompts, params, use_tqdm=False)
    squeezed = LLM(folder, num_blocks=30, block_size=4).generate(prompts, params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in plain]
    for ids in expected:
        assert tuple(ids[7:10]) == END
    assert [list(o.outputs[0].token_ids) for o in drafted] == expected
    assert [list(o.outputs[0].token_ids) for o in squeezed] == expected
    assert speculating.engine.spec_stats.num_drafts > 0
    assert sum(o.metrics.num_preemptions for o in squeezed) > 0


def test_an_end_outside_the_vocabulary_is_refused_before_queueing(tiny):
    vocab = tiny.get_tokenizer().vocab_size * 4
    bad = SamplingParams(max_tokens=4, thinking=ThinkingParams((vocab,), 1))
    with pytest.raises(InvalidParameterError) as refused:
        tiny.generate({"prompt_token_ids": PROMPTS[0]}, bad, use_tqdm=False)
    assert refused.value.param == "thinking" and not tiny.engine.has_unfinished_requests()
