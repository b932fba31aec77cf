"""Bad request values are refused at the door, naming the field, before they can reach
a batched step (where one request's bad value would fail every request in it): the
reproducers of the hardening issue that the engine itself met."""

from __future__ import annotations

import math

import pytest

from tandem import LLM, SamplingParams
from tandem.errors import InvalidParameterError


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "min_p",
                                   "presence_penalty", "frequency_penalty"])  # fmt: skip
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_floats_must_be_finite(field, value):
    with pytest.raises(InvalidParameterError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("seed, n", [(2**64, 1), (-(2**63) - 1, 1), (2**64 - 1, 2)])
def test_seeds_must_fit_a_generator(seed, n):
    with pytest.raises(InvalidParameterError, match="seed"):
        SamplingParams(seed=seed, n=n)
    SamplingParams(seed=2**64 - n, n=n)  # the largest that fits


def test_out_of_vocabulary_stop_token_ids_are_refused_alone(model_dirs):
    folder, _ = model_dirs("llama")
    llm = LLM(str(folder))
    bad = SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[99999])
    with pytest.raises(InvalidParameterError, match="stop_token_ids"):
        llm.generate("import os", bad, use_tqdm=False)
    # the engine is unharmed: the next request runs
    ok = SamplingParams(max_tokens=4, temperature=0.0)
    assert len(llm.generate("import os", ok, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_extreme_but_valid_values_run_beside_other_requests(model_dirs):
    """top_k of 2^63 means "no limit"; the largest seed works; neither changes what the
    requests beside it produce."""
    folder, _ = model_dirs("llama")
    llm = LLM(str(folder))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["The quick", "Paged attention"], greedy, use_tqdm=False)
    extreme = SamplingParams(max_tokens=6, top_k=2**63, seed=2**64 - 1, ignore_eos=True)
    mixed = llm.generate(
        ["The quick", "import os", "Paged attention"], [greedy, extreme, greedy], use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == [
        o.outputs[0].token_ids for o in alone
    ]
    assert len(mixed[1].outputs[0].token_ids) == 6
