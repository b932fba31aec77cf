"""The int8 KV cache (kv_cache_dtype="int8"): a quarter of float32's bytes per value,
and outputs that stay with the float cache's, through decode and chunked prefill
(later chunks read the earlier ones' K/V back from int8)."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.errors import InvalidParameterError
from tandem.runner.kv_cache import kv_bytes_per_block

PROMPTS = [
    {"prompt_token_ids": list(range(5, 60))},
    {"prompt_token_ids": [7, 8, 9] * 20},
    {"prompt_token_ids": list(range(100, 130))},
]


@pytest.mark.parametrize("chunk", [None, 16])
def test_outputs_stay_with_the_float_cache(model_dirs, chunk):
    folder, _ = model_dirs("llama")
    options = {} if chunk is None else {"max_num_batched_tokens": chunk}
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    exact = LLM(str(folder), **options).generate(PROMPTS, params, use_tqdm=False)
    int8 = LLM(str(folder), kv_cache_dtype="int8", **options).generate(
        PROMPTS, params, use_tqdm=False
    )
    for a, b in zip(exact, int8, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for position, token in enumerate(a.token_ids):
            gap = a.logprobs[position][token].logprob - b.logprobs[position][token].logprob
            assert abs(gap) < 0.01


def test_the_same_budget_holds_about_four_times_the_tokens(model_dirs):
    folder, _ = model_dirs("llama")
    budget = 1 << 20
    exact = LLM(str(folder), kv_cache_memory=budget).engine.runner
    int8 = LLM(str(folder), kv_cache_memory=budget, kv_cache_dtype="int8").engine.runner
    config = exact.config
    ratio = kv_bytes_per_block(config, 16, exact.loaded.dtype) / kv_bytes_per_block(
        config, 16, exact.loaded.dtype, "int8"
    )
    assert ratio == pytest.approx(4 * config.head_dim / (config.head_dim + 4))
    assert int8.kv_cache.shape[2] == pytest.approx(exact.kv_cache.shape[2] * ratio, rel=0.02)
    assert int8.kv_cache.nbytes <= budget


def test_an_unknown_kv_cache_dtype_is_refused(model_dirs):
    folder, _ = model_dirs("llama")
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
        LLM(str(folder), kv_cache_dtype="fp4")
