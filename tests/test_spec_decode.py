"""Speculative decoding is lossless: greedy outputs equal plain decoding token for token
(and transformers), under chunked prefill, preemption and prefix-cache hits; sampled
outputs follow the target's distribution (chi-square against the exact marginals),
even with a deliberately bad draft; rejected drafts leave no K/V behind."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import httpx
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import InvalidParameterError
from tandem.server.launch import tandem_process
from tandem.spec_decode.ngram import ngram_proposal
from tests.hf_models import VOCAB_SIZE, reference_greedy


def test_ngram_proposal_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ngram_proposal(tokens, 2, n_max=3, n_min=1) == [7, 5]  # the latest "1 2 3"
    assert ngram_proposal([4, 5, 6], 3, n_max=3, n_min=1) == []
    assert ngram_proposal([8, 1, 8], 3, n_max=2, n_min=1) == [1, 8]


@pytest.fixture(scope="module")
def target(model_dirs):
    return model_dirs("llama")


@pytest.fixture(scope="module")
def bad_draft(model_dirs):
    """Another random model with the same vocabulary: it rarely agrees with the target."""
    return model_dirs("llama", num_hidden_layers=1, seed=7)[0]


def repetitive_prompts(seed: int, lengths) -> list[list[int]]:
    """Random prompts built from a few repeated phrases, so n-gram lookup has matches."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(3, 6))] for _ in range(5)]
    prompts = []
    for length in lengths:
        ids: list[int] = []
        while len(ids) < length:
            ids += rng.choice(phrases)
        prompts.append(ids[:length])
    return prompts


SETTINGS = {
    "chunked prefill": dict(max_num_batched_tokens=24, block_size=4),
    "preemption": dict(block_size=4, num_blocks=40, max_num_batched_tokens=64),
    "prefix hits": dict(block_size=4),
}


def greedy_outputs(llm, prompts, **params):
    sampling = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **params)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], outputs


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize(
    "method", ["ngram", "suffix", "draft-self", "draft-bad", "layer_skip", "eagle"]
)
def test_greedy_equals_plain_decoding(target, bad_draft, eagle_heads, setting, method):
    folder, hf_model = target
    prompts = repetitive_prompts(1, [30, 11, 45, 8, 26, 17])
    if setting == "prefix hits":  # later prompts share a start with earlier ones
        prompts += [prompts[0][:24] + prompts[3], prompts[2][:36] + prompts[1][:5]]
    options = SETTINGS[setting]
    plain = LLM(str(folder), **options)
    kind, _, draft = method.partition("-")
    spec = {"method": kind, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    if kind == "draft":
        spec["model"] = str(folder if draft == "self" else bad_draft)
    if kind == "eagle":
        spec["model"] = eagle_heads(folder)
    llm = LLM(str(folder), speculative_config=spec, **options)
    if setting == "prefix hits":  # cache the first prompts; the later ones then hit
        assert greedy_outputs(llm, prompts[:3])[0] == greedy_outputs(plain, prompts[:3])[0]
    expected, _ = greedy_outputs(plain, prompts)
    got, outputs = greedy_outputs(llm, prompts)
    assert got == expected
    # ... and both equal transformers, for the first prompt.
    assert got[0] == reference_greedy(hf_model, prompts[:1], 24)[0]
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    if method == "draft-self":
        assert stats.acceptance_rate == 1.0  # the draft is the target: every guess holds
    if setting == "preemption":
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
    if setting == "prefix hits":
        assert any(o.num_cached_tokens for o in outputs)
    llm.engine.kv_manager.check_no_leaks()


def test_penalties_stop_strings_and_logprobs_match_plain_decoding(target):
    folder, _ = target
    prompts = repetitive_prompts(2, [20, 33])
    params = dict(repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2, min_tokens=5)
    plain = LLM(str(folder))
    expected, plain_outputs = greedy_outputs(plain, prompts, **params)
    spec = LLM(str(folder), speculative_config={"method": "draft", "model": str(folder)})
    got, spec_outputs = greedy_outputs(spec, prompts, **params)
    assert got == expected
    for a, b in zip(plain_outputs, spec_outputs, strict=True):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)
    # A stop string inside a run of accepted drafts ends the output where plain decoding does.
    text = plain_outputs[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    _, stopped_plain = greedy_outputs(plain, prompts[:1], stop=[stop], **params)
    _, stopped_spec = greedy_outputs(spec, prompts[:1], stop=[stop], **params)
    a, b = stopped_plain[0].outputs[0], stopped_spec[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, "stop")


def test_a_batch_of_mixed_requests_verifies_as_each_decodes_alone(target):
    """Greedy requests with nothing changing their logits take their targets from one
    argmax of the whole step, beside penalised, banned and biased greedy requests and
    seeded sampled ones: each gets the tokens plain decoding gives it."""
    folder, _ = target
    prompts = repetitive_prompts(3, [20, 33, 12, 27, 9, 40])
    base = dict(max_tokens=24, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, **base),
        SamplingParams(temperature=0, repetition_penalty=1.3, **base),
        SamplingParams(temperature=0, **base),
        SamplingParams(temperature=0.8, seed=5, **base),
        SamplingParams(temperature=0, logit_bias={7: 3.0}, min_tokens=4, **base),
        SamplingParams(temperature=0, **base),
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(str(folder)).generate(requests, params, use_tqdm=False)
    spec = {"method": "draft", "model": str(folder), "num_speculative_tokens": 3}
    llm = LLM(str(folder), speculative_config=spec)
    got = llm.generate(requests, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(plain, got, strict=True)):
        if params[i].temperature == 0:
            assert b.outputs[0].token_ids == a.outputs[0].token_ids, i
    assert llm.engine.spec_stats.num_drafts > 0


def test_rejected_drafts_leave_no_kv(target, bad_draft):
    folder, _ = target
    llm = LLM(str(folder), block_size=4, speculative_config={
        "method": "draft", "model": str(bad_draft), "num_speculative_tokens": 4,
    })  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(repetitive_prompts(3, [9, 14, 21])):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    kv = engine.kv_manager
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            # Exactly the blocks its computed tokens need: none holds only rejected drafts.
            assert len(kv.block_table(request.request_id)) == kv.blocks_needed(
                request.num_computed_tokens
            )
    assert engine.spec_stats.num_accepted_tokens < engine.spec_stats.num_draft_tokens
    kv.check_no_leaks()


def test_bad_settings_are_named(target, model_dirs):
    folder, _ = target
    with pytest.raises(InvalidParameterError, match="method"):
        LLM(str(folder), speculative_config={"method": "medusa"})
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens"):
        LLM(str(folder), speculative_config={"num_speculative_tokens": 0})
    other_vocab = model_dirs("llama", vocab_size=VOCAB_SIZE + 8)[0]
    with pytest.raises(InvalidParameterError, match="vocabulary"):
        LLM(str(folder), speculative_config={"method": "draft", "model": str(other_vocab)})


# -- lossless sampling -------------------------------------------------------------------

VOCAB = 16
PROMPT = [3, 9, 4, 12, 7]
NEW_TOKENS = 4  # the first from the prompt, then two drafts and a bonus in one step


@pytest.fixture(scope="module")
def small_vocab(model_dirs):
    """A target and a bad draft over 16 tokens, so every token's frequency is testable."""
    target_folder, target_hf = model_dirs("llama", vocab_size=VOCAB)
    draft_folder, _ = model_dirs("llama", vocab_size=VOCAB, num_hidden_layers=1, seed=3)
    return target_folder, target_hf, draft_folder


def target_probs(hf_model, sequences, temperature, top_k):
    with torch.no_grad():
        logits = hf_model(torch.tensor(sequences)).logits[:, -1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.softmax(-1)


def exact_marginals(hf_model, temperature, top_k) -> list[torch.Tensor]:
    """P(token j = v) for each generated position j, by enumerating every path."""
    paths, weights, marginals = [[]], torch.ones(1, dtype=torch.float64), []
    for _ in range(NEW_TOKENS):
        probs = target_probs(hf_model, [PROMPT + p for p in paths], temperature, top_k)
        joint = weights[:, None] * probs.double()
        marginals.append(joint.sum(0))
        if len(marginals) < NEW_TOKENS:
            paths = [[*p, v] for p in paths for v in range(VOCAB)]
            weights = joint.flatten()
    return marginals


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; cells expected to hold fewer than 5 samples are pooled."""
    total = float(counts.sum())
    expected = expected_probs * total
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


def position_counts(llm, samples: int, temperature, top_k, seed) -> list[torch.Tensor]:
    params = SamplingParams(
        n=samples, temperature=temperature, top_k=top_k, max_tokens=NEW_TOKENS,
        ignore_eos=True, seed=seed,
    )  # fmt: skip
    output = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    counts = [torch.zeros(VOCAB, dtype=torch.float64) for _ in range(NEW_TOKENS)]
    for completion in output.outputs:
        for position, token in enumerate(completion.token_ids):
            counts[position][token] += 1
    return counts


SAMPLES = 2000
P_VALUE_FLOOR = 1e-3  # per position; fixed seeds make the outcome deterministic


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 6)])
@pytest.mark.parametrize("proposer", ["bad-draft", "ngram", "suffix", "layer-skip", "eagle"])
def test_sampled_tokens_follow_the_target_distribution(
    small_vocab, eagle_heads, proposer, temperature, top_k
):
    target_folder, target_hf, draft_folder = small_vocab
    if proposer == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    elif proposer == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": 2}
    elif proposer == "layer-skip":  # the target without its last layer
        spec = {"method": "layer_skip", "num_speculative_tokens": 2}
    elif proposer == "eagle":  # guesses 12 of the 16 tokens
        spec = {"method": "eagle", "model": eagle_heads(target_folder), "num_speculative_tokens": 2}
    else:
        spec = {"method": "draft", "model": str(draft_folder), "num_speculative_tokens": 2}
    spec["disable_by_batch_size"] = None
    llm = LLM(str(target_folder), max_num_seqs=512, speculative_config=spec)
    counts = position_counts(llm, SAMPLES, temperature, top_k, seed=11)
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for position, expected in enumerate(exact_marginals(target_hf, temperature, top_k)):
        assert chi_square_p_value(counts[position], expected) > P_VALUE_FLOOR, position


def test_the_chi_square_check_catches_a_wrong_distribution(small_vocab):
    """Power check: the draft model's own samples (a different distribution) fail the
    very check that speculative samples pass, at every position."""
    _target_folder, target_hf, draft_folder = small_vocab
    counts = position_counts(LLM(str(draft_folder), max_num_seqs=512), SAMPLES, 1.0, 0, seed=11)
    marginals = exact_marginals(target_hf, 1.0, 0)
    p_values = [chi_square_p_value(c, m) for c, m in zip(counts, marginals, strict=True)]
    assert max(p_values) < P_VALUE_FLOOR


def test_drafts_are_seed_reproducible(small_vocab):
    target_folder, _, draft_folder = small_vocab
    spec = {
        "method": "draft",
        "model": str(draft_folder),
        "disable_by_batch_size": None,
        "adaptive": False,
    }  # (adaptive decisions follow timing: spec_control.py)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    runs = [
        [c.token_ids for c in LLM(str(target_folder), speculative_config=spec)
         .generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs]
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in itertools.chain(runs[0])}) > 1
    assert Counter(len(t) for t in runs[0]) == {12: 4}


def test_the_server_speculates_and_reports_it(target):
    folder, _ = target
    with tandem_process(
        "serve", "--model", str(folder), "--served-model-name", "tiny",
        "--speculative-method", "draft", "--draft-model", str(folder),
        "--num-speculative-tokens", "3",
    ) as url:  # fmt: skip
        prompt = repetitive_prompts(4, [20])[0]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        expected = LLM(str(folder)).generate(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert text["choices"][0]["text"] == expected.outputs[0].text
        metrics = httpx.get(f"{url}/metrics").text
        drafts = [line for line in metrics.splitlines()
                  if line.startswith("tandem:spec_decode_num_accepted_tokens_total")]  # fmt: skip
        assert drafts and float(drafts[0].split()[-1]) > 0


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_the_runner_copy_of_every_request_matches_the_scheduler(target, bad_draft, method):
    """The scheduler sends diffs (new requests once, then block-table changes); the
    runner keeps its own tokens and tables. Under preemption, prefix hits and drafts
    rejected and freed, both sides must agree after every step."""
    folder, _ = target
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    if method == "draft":
        spec["model"] = str(bad_draft)
    llm = LLM(str(folder), speculative_config=spec, block_size=4, num_blocks=40,
              max_num_batched_tokens=64)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = repetitive_prompts(5, [9, 14, 21, 30, 9, 14])
    for i, prompt in enumerate([*prompts, prompts[0]]):  # the last one: a prefix hit
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    preempted = 0
    batch = engine.executor.runner.input_batch
    while engine.has_unfinished_requests():
        engine.step()
        preempted += sum(len(r.timeline.preemption_times) for r in engine.scheduler.waiting)
        for request in engine.scheduler.running:
            state = batch.requests[request.request_id]
            table = engine.kv_manager.block_table(request.request_id)
            # Past the table: blocks freed after rejected drafts, replaced when the
            # request is next scheduled (never read before).
            assert state.block_ids[: len(table)] == table
            assert state.all_token_ids == request.all_token_ids
    assert preempted and engine.spec_stats.num_draft_tokens
    engine.step()  # an empty step tells the runner of the last finished requests
    assert not batch.requests and not batch.generators
    engine.kv_manager.check_no_leaks()


def test_the_engine_stops_drafting_with_a_draft_that_never_pays(target, bad_draft):
    """Adaptive speculation (spec_control.py) on the real engine: a draft that costs a
    forward pass per guess and is rarely right is measured as a loss and switched off
    (probes aside). Its margin is wide: a speculative step there takes several plain
    steps' time for about one token."""
    from tandem.engine.observer import EngineObserver

    folder, _ = target
    llm = LLM(str(folder), speculative_config={
        "method": "draft", "model": str(bad_draft), "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
    })  # fmt: skip

    class Count(EngineObserver):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def step_done(self, out, stats):
            if out is not None and out.scheduled:
                self.steps.append(stats.num_speculating)

    count = Count()
    llm.engine.add_observer(count)
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    llm.generate({"prompt_token_ids": list(range(5, 25))}, params, use_tqdm=False)
    late = count.steps[len(count.steps) // 2 :]
    assert sum(1 for n in late if n) <= len(late) / 4, count.steps  # probes only
    assert llm.engine.scheduler.spec_control.num_switches >= 1


def test_tune_layer_skip_ranks_candidates_by_measured_agreement(target):
    """The tuner's agreement is the draft's teacher-forced greedy match with the target,
    counted here by hand for one candidate; nothing skipped would agree everywhere."""
    from tandem.runner.model_runner import forward_no_cache
    from tandem.spec_decode.layer_skip import skipping
    from tandem.train.layer_skip_tuning import calibration_text, tune

    folder, _ = target
    llm = LLM(str(folder))
    candidates = tune(llm, num_prompts=2, num_tokens=16)
    assert [c.speedup for c in candidates] == sorted((c.speedup for c in candidates),
                                                      reverse=True)  # fmt: skip
    loaded = llm.engine.executor.runner.loaded
    texts = calibration_text(llm, 2, 16)
    one = candidates[0]
    agree = total = 0
    for ids, start in texts:
        full = forward_no_cache(loaded, torch.tensor([ids]))[0, start - 1 : -1].argmax(-1)
        with skipping(loaded.model, one.layers):
            part = forward_no_cache(loaded, torch.tensor([ids]))[0, start - 1 : -1].argmax(-1)
        agree += int((full == part).sum())
        total += len(full)
    assert one.agreement == pytest.approx(agree / total)
    assert loaded.model.skipped_layers == frozenset()  # restored after tuning
