"""SamplingParams.prompt_logprobs: each prompt token's log-probability under the model
given the tokens before it (and the k best), against transformers' log-softmax on the
same weights, whatever the engine does to the prompt (chunks, a warm prefix cache,
n > 1 children, preemption)."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import InvalidParameterError
from tandem.runner import model_runner
from tandem.sampling import RequestOutputKind

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def setup(model_dirs):
    folder, hf_model = model_dirs("llama")
    with torch.no_grad():
        reference = hf_model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    return str(folder), reference


def check(prompt_logprobs, reference, k: int) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        entry, expected = prompt_logprobs[position], reference[position - 1]
        token = PROMPT[position]
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
        ranked = {t: lp.rank for t, lp in entry.items() if lp.rank is not None}
        assert sorted(ranked.values()) == list(range(1, k + 1))
        assert set(ranked) == set(expected.topk(k).indices.tolist())


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 8}, {"num_blocks": 24, "block_size": 4}],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_logprobs_equal_transformers(setup, options):
    folder, reference = setup
    llm = LLM(folder, **options)
    preempting = "num_blocks" in options  # 3 requests of 15 blocks each in 24
    params = SamplingParams(
        max_tokens=20 if preempting else 3, temperature=0, prompt_logprobs=2,
        n=1 if preempting else 2, ignore_eos=True,
    )  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, params, use_tqdm=False)
    for output in outputs:
        check(output.prompt_logprobs, reference, 2)
    if preempting:
        assert any(o.metrics.num_preemptions for o in outputs)


def test_logits_made_a_few_rows_at_a_time_score_the_same(setup, monkeypatch):
    folder, reference = setup
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 7)
    params = SamplingParams(max_tokens=1, prompt_logprobs=3)
    output = LLM(folder).generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    check(output.prompt_logprobs, reference, 3)


def test_a_cached_prompt_is_scored_whole(setup):
    """The prefix cache would skip the prompt's computation: such requests bypass it."""
    folder, reference = setup
    llm = LLM(folder, enable_prefix_caching=True, block_size=4)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert output.num_cached_tokens == 0
    check(output.prompt_logprobs, reference, 1)


def test_streamed_outputs_carry_them_once(setup):
    folder, reference = setup
    engine = LLM(folder).engine
    params = SamplingParams(
        max_tokens=4, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA, ignore_eos=True
    )
    engine.add_request("r", {"prompt_token_ids": PROMPT}, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step()]
    assert seen[0] is not None and all(p is None for p in seen[1:])
    check(seen[0], reference, 0)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_values_are_refused(value):
    with pytest.raises(InvalidParameterError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
