"""KV caches that store less than the model computes in: int8 rows with scales,
bfloat16 and fp8 (e4m3) on a float32 model. Outputs stay with the float cache's,
through decode and chunked prefill (later chunks read the earlier ones' K/V back), on
the CPU and, where there is one, on a CUDA GPU (the Triton kernel for every type)."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import InvalidParameterError
from tandem.runner.kv_cache import kv_bytes_per_block

PROMPTS = [
    {"prompt_token_ids": list(range(5, 60))},
    {"prompt_token_ids": [7, 8, 9] * 20},
    {"prompt_token_ids": list(range(100, 130))},
]
# The largest log-probability gap each cache type may cause on the tiny random model:
# bfloat16 and int8 keep 8 significant bits, fp8 e4m3 four. The random model's
# distributions are nearly flat, so fp8's rounding flips near-ties: its greedy tokens
# may part from the float cache's, but only at a near-tie (the float choice is within
# the tolerance of the fp8 one). docs/QUALITY.md measures fp8 on real text.
TOLERANCE = {"int8": 0.01, "bfloat16": 0.01, "fp8": 0.05}


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", list(TOLERANCE))
@pytest.mark.parametrize("chunk", [None, 16])
def test_outputs_stay_with_the_float_cache(model_dirs, chunk, kv_dtype, device):
    folder, _ = model_dirs("llama")
    options = {"device": device}
    if chunk is not None:
        options["max_num_batched_tokens"] = chunk
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    exact = LLM(str(folder), **options).generate(PROMPTS, params, use_tqdm=False)
    smaller = LLM(str(folder), kv_cache_dtype=kv_dtype, **options).generate(
        PROMPTS, params, use_tqdm=False
    )
    for a, b in zip(exact, smaller, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        agreeing = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
            len(a.token_ids),
        )
        if kv_dtype != "fp8":
            assert agreeing == len(a.token_ids)
        for position, token in enumerate(a.token_ids[: agreeing + 1]):
            if position == len(a.token_ids):
                break
            ours = b.logprobs[position]
            assert token in ours  # at a parting, the float choice is a near-tie
            assert (
                abs(a.logprobs[position][token].logprob - ours[token].logprob)
                < (TOLERANCE[kv_dtype])
            )


@pytest.mark.parametrize("kv_dtype, element_bytes", [("int8", 1), ("bfloat16", 2), ("fp8", 1)])
def test_the_same_budget_holds_more_tokens(model_dirs, kv_dtype, element_bytes):
    folder, _ = model_dirs("llama")
    budget = 1 << 20
    exact = LLM(str(folder), kv_cache_memory=budget).engine.executor.runner
    smaller = LLM(str(folder), kv_cache_memory=budget, kv_cache_dtype=kv_dtype)
    smaller = smaller.engine.executor.runner
    config = exact.config
    ratio = kv_bytes_per_block(config, 16, exact.loaded.dtype) / kv_bytes_per_block(
        config, 16, exact.loaded.dtype, kv_dtype
    )
    extra = 4 if kv_dtype == "int8" else 0  # an int8 row's scale
    assert ratio == pytest.approx(4 * config.head_dim / (element_bytes * config.head_dim + extra))
    assert smaller.kv_cache.shape[2] == pytest.approx(exact.kv_cache.shape[2] * ratio, rel=0.02)
    assert smaller.kv_cache.nbytes <= budget


def test_an_unknown_kv_cache_dtype_is_refused(model_dirs):
    folder, _ = model_dirs("llama")
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
        LLM(str(folder), kv_cache_dtype="fp4")
