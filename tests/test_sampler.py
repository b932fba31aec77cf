"""The batched sampler against a direct, row-by-row computation on known logits."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.errors import InvalidParameterError
from tandem.runner.sampler import SamplingRow, apply_penalties, sample, sampling_probs
from tandem.sampling import SamplingParams, model_sampling_defaults

VOCAB = 12


def row(prompt=(), output=(), generator=None, banned=(), **params):
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, banned)


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """Temperature, then top-k, then top-p, then min-p, written out plainly."""
    scaled = [x / p.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order[: p.top_k] if p.top_k > 0 else order
    total = sum(math.exp(scaled[i]) for i in keep)
    kept, mass = [], 0.0
    for i in keep:
        if mass >= p.top_p:
            break
        kept.append(i)
        mass += math.exp(scaled[i]) / total
    total = sum(math.exp(scaled[i]) for i in kept)
    probs = [math.exp(scaled[i]) / total if i in kept else 0.0 for i in range(len(scaled))]
    if p.min_p > 0:
        threshold = p.min_p * max(probs)
        probs = [x if x >= threshold else 0.0 for x in probs]
        total = sum(probs)
        probs = [x / total for x in probs]
    return probs


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.5, top_k=3),
    dict(temperature=1.3, top_p=0.6),
    dict(temperature=0.8, top_k=5, top_p=0.9),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=2.0, top_k=4, top_p=0.95, min_p=0.05),
    dict(temperature=1.0, top_p=0.01),  # keeps only the best token
]


def test_sampling_probs_match_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(len(SETTINGS), VOCAB) * 2
    rows = [row(**s) for s in SETTINGS]
    probs = sampling_probs(logits.clone(), rows)
    for i, settings in enumerate(SETTINGS):
        expected = reference_probs(logits[i].tolist(), SamplingParams(**settings))
        assert probs[i].tolist() == pytest.approx(expected, abs=1e-6), settings


def test_penalties_match_direct_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    prompt, output = [0, 4], [3, 3, 5]
    r = row(prompt, output, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3)
    got = apply_penalties(logits.clone(), [r])[0].tolist()
    expected = []
    for token, value in enumerate(logits[0].tolist()):
        if token in prompt or token in output:
            value = value / 1.5 if value > 0 else value * 1.5
        count = output.count(token)
        value -= 0.3 * count + 0.4 * (count > 0)
        expected.append(value)
    assert got == pytest.approx(expected)


def test_greedy_is_argmax_and_banned_tokens_are_skipped():
    logits = torch.tensor([[0.1, 5.0, 0.3, 4.0], [3.0, 0.0, 1.0, 0.0]])
    rows = [row(temperature=0, banned=(1,)), row(temperature=0)]
    assert [t.token_id for t in sample(logits, rows)] == [3, 0]


def test_seeded_draws_follow_the_distribution_and_repeat():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(4000):
        draws.append(
            sample(logits.clone(), [row(temperature=1.0, generator=generator)])[0].token_id
        )
    frequencies = [draws.count(t) / len(draws) for t in range(4)]
    assert frequencies == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.03)
    again = torch.Generator().manual_seed(0)
    repeat = [
        sample(logits.clone(), [row(temperature=1.0, generator=again)])[0].token_id
        for _ in range(50)
    ]
    assert repeat == draws[:50]


def test_logprobs_are_raw_and_ranked():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    result = sample(
        logits.clone(), [row(temperature=0, logprobs=2, repetition_penalty=2.0, output=[1])]
    )
    expected = logits.log_softmax(-1)[0]
    # The penalty changed the choice (token 1's logit halves) but not the logprobs.
    assert result[0].token_id == 2
    assert result[0].logprob == pytest.approx(expected[2].item())
    assert [t for t, _ in result[0].top_logprobs] == [1, 2]
    assert result[0].top_logprobs[0][1] == pytest.approx(expected[1].item())


def test_model_sampling_defaults_read_generation_config_keys():
    config = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64, "eos_token_id": 2}
    assert model_sampling_defaults(config) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    # transformers' do_sample=False is greedy whatever temperature says.
    assert model_sampling_defaults({"do_sample": False, "temperature": 0.6}) == {"temperature": 0.0}
    assert model_sampling_defaults({}) == {}


def test_logit_bias_adds_to_the_logits_and_leaves_the_logprobs_raw():
    """OpenAI's logit_bias: each listed token's logit moves by its bias before the
    choice (-100 bans, +100 forces); the reported logprobs stay the model's."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0] + [0.0] * (VOCAB - 4)] * 3)
    rows = [
        row(temperature=0, logprobs=1),
        row(temperature=0, logprobs=1, logit_bias={1: -100.0}),
        row(temperature=0, logprobs=1, logit_bias={2: 100.0, 3: 0.5}),
    ]
    out = sample(logits, rows)
    assert [o.token_id for o in out] == [1, 3, 2]
    raw = torch.log_softmax(logits[0], -1)
    assert out[2].logprob == pytest.approx(raw[2].item(), abs=1e-6)
    assert logits[0, 1] == 3.0  # the caller's logits untouched


@pytest.mark.parametrize(
    "bias", [{-1: 1.0}, {"5": 1.0}, {5: 101.0}, {5: float("nan")}, {True: 1.0}, {5: "1"}]
)
def test_bad_logit_bias_is_refused_naming_it(bias):
    with pytest.raises(InvalidParameterError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
