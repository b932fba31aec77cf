"""The engine end to end on tiny random-weight models, against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import InvalidParameterError
from tests.hf_models import VOCAB_SIZE, reference_greedy

MAX_NEW = 10
PROMPT_LENS = [3, 40, 7, 25, 1, 18, 33, 5, 12, 29, 9, 2, 37, 16, 21, 11]


@pytest.fixture(scope="module")
def llama(model_dirs):
    return model_dirs("llama")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(2, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_greedy(llama, prompts):
    """transformers' greedy continuation of each prompt, one prompt at a time."""
    return reference_greedy(llama[1], prompts, MAX_NEW)


_created: list[LLM] = []


@pytest.fixture(autouse=True)
def no_leaked_blocks():
    """After every test, every engine it made holds no KV block and no request."""
    _created.clear()
    yield
    for llm in _created:
        assert not llm.engine.has_unfinished_requests()
        llm.engine.kv_manager.check_no_leaks()


def make_llm(folder, **options):
    llm = LLM(str(folder), **options)
    _created.append(llm)
    return llm


def greedy(max_tokens=MAX_NEW, **kwargs):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


ENGINE_SETTINGS = {
    # small budget (chunking), few blocks (preemption), odd block size
    "chunked-pressure": dict(max_num_batched_tokens=16, block_size=5, num_blocks=30),
    "chunked-tiny-budget": dict(max_num_batched_tokens=7, block_size=3, num_blocks=60),
    "chunk-cap": dict(
        max_num_batched_tokens=64, long_prefill_token_threshold=4, block_size=16, num_blocks=40
    ),
    "no-chunking": dict(max_num_batched_tokens=512, block_size=16, num_blocks=200),
    "prefill-first-pressure": dict(
        scheduling_policy="prefill-first", max_num_batched_tokens=32, block_size=5, num_blocks=30
    ),
    "few-seqs": dict(max_num_seqs=3, max_num_batched_tokens=24, block_size=7, num_blocks=40),
}
EXPECT_PREEMPTION = {"chunked-pressure", "prefill-first-pressure"}


@pytest.mark.parametrize("setting", ENGINE_SETTINGS)
def test_greedy_matches_transformers(llama, prompts, hf_greedy, setting):
    llm = make_llm(llama[0], **ENGINE_SETTINGS[setting])
    outputs = llm.generate(token_prompts(prompts), greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    preemptions = sum(o.metrics.num_preemptions for o in outputs)
    if setting in EXPECT_PREEMPTION:
        assert preemptions > 0, "the setting was meant to force preemption"


def test_metrics_are_consistent(llama, prompts):
    llm = make_llm(llama[0], max_num_batched_tokens=16)
    outputs = llm.generate(token_prompts(prompts[:4]), greedy(), use_tqdm=False)
    for output in outputs:
        m = output.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == MAX_NEW
        assert len(m.inter_token_latencies) == MAX_NEW - 1
        assert m.ttft > 0 and m.tpot > 0


def test_seeded_sampling_does_not_depend_on_the_batch(llama, prompts):
    llm = make_llm(llama[0], max_num_batched_tokens=32)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    alone = llm.generate(token_prompts(prompts[:1]), params, use_tqdm=False)[0]
    others = SamplingParams(temperature=0.7, max_tokens=12)
    mixed = llm.generate(token_prompts(prompts[:6]), [params] + [others] * 5, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids
    again = llm.generate(token_prompts(prompts[:1]), params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids


def test_n_samples_are_distinct_and_reproducible(llama, prompts):
    llm = make_llm(llama[0])
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)
    first = llm.generate(token_prompts(prompts[:1]), params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) == 3
    second = llm.generate(token_prompts(prompts[:1]), params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in second.outputs] == samples
    llm.engine.kv_manager.check_no_leaks()


def test_max_tokens_stop_token_ids_and_min_tokens(llama, prompts, hf_greedy):
    llm = make_llm(llama[0])
    expected = hf_greedy[1]
    stop_token = expected[3]
    first_index = expected.index(stop_token)
    out = llm.generate(
        token_prompts([prompts[1]]), greedy(stop_token_ids=[stop_token]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == expected[: first_index + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    # min_tokens bans the stop token until enough tokens exist.
    out = llm.generate(
        token_prompts([prompts[1]]),
        greedy(stop_token_ids=[stop_token], min_tokens=first_index + 3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= first_index + 3
    assert stop_token not in out.token_ids[: first_index + 2]
    out = llm.generate(token_prompts([prompts[1]]), greedy(max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[:4]


def test_stop_strings_end_generation_and_are_not_emitted(llama):
    folder, _ = llama
    llm = make_llm(folder)
    prompt = "Paged attention keeps the KV cache"
    full = llm.generate(prompt, greedy(max_tokens=24), use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[5:8]
    assert len(stop) == 3 and text.find(stop) == 5
    out = llm.generate(prompt, greedy(max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:5]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    out = llm.generate(
        prompt, greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert out.text == text[:8]
    # A stop string that never appears loses nothing of the text.
    out = llm.generate(prompt, greedy(max_tokens=24, stop=["\x00zz"]), use_tqdm=False)[0]
    assert out.outputs[0].text == text


def test_text_prompts_and_chat(llama):
    folder, _ = llama
    llm = make_llm(folder)
    tokenizer = llm.get_tokenizer()
    by_text = llm.generate(["The quick brown fox"], greedy(), use_tqdm=False)[0]
    assert by_text.prompt == "The quick brown fox"
    assert by_text.prompt_token_ids == tokenizer.encode("The quick brown fox")
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = llm.chat(conversation, greedy(), use_tqdm=False)[0]
    assert chat.prompt_token_ids == tokenizer.encode_chat(conversation)


def test_logprobs_are_the_raw_log_softmax(llama, prompts):
    folder, hf_model = llama
    llm = make_llm(folder)
    out = llm.generate(
        token_prompts([prompts[3]]), greedy(max_tokens=1, logprobs=3), use_tqdm=False
    )
    completion = out[0].outputs[0]
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompts[3]])).logits[0, -1].float().log_softmax(-1)
    top = reference.topk(3)
    entry = completion.logprobs[0]
    assert [lp.rank for lp in entry.values()] == [1, 2, 3]
    assert list(entry) == top.indices.tolist()
    for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(top.values[0].item(), abs=1e-4)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logprobs=100), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_values_name_the_field(params, field):
    with pytest.raises(InvalidParameterError, match=f"^{field}:") as info:
        SamplingParams(**params)
    assert info.value.param == field


def test_bad_requests_queue_nothing(llama, prompts):
    llm = make_llm(llama[0], max_model_len=64, num_blocks=8, block_size=4)
    good = token_prompts([prompts[0], prompts[2]])  # 3 and 7 tokens: fit in 8 blocks
    with pytest.raises(InvalidParameterError, match="max_model_len"):
        llm.generate([*good, {"prompt_token_ids": [5] * 60}], greedy(max_tokens=10), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="KV blocks"):
        llm.generate([{"prompt_token_ids": [5] * 30}], greedy(max_tokens=10), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match=r"token ids must be in \[0"):
        llm.generate([{"prompt_token_ids": [VOCAB_SIZE + 5]}], greedy(), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="prompt: is empty"):
        llm.generate([{"prompt_token_ids": []}], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv_manager.check_no_leaks()
    # The engine still serves afterwards.
    assert len(llm.generate(good, greedy(max_tokens=3), use_tqdm=False)) == 2


def test_unknown_engine_option_is_named(llama):
    with pytest.raises(InvalidParameterError, match="max_num_batched_tokenz"):
        make_llm(llama[0], max_num_batched_tokenz=8)
    with pytest.raises(InvalidParameterError, match="scheduling_policy"):
        make_llm(llama[0], scheduling_policy="fastest")


def test_abort_frees_blocks_and_others_finish(llama, prompts, hf_greedy):
    llm = make_llm(llama[0], max_num_batched_tokens=8)
    engine = llm.engine
    for i, ids in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, greedy())
    for _ in range(3):
        engine.step()
    engine.abort("r1")
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert set(finished) == {"r0", "r2", "r3"}
    assert [finished[f"r{i}"] for i in (0, 2, 3)] == [hf_greedy[i] for i in (0, 2, 3)]
    engine.kv_manager.check_no_leaks()


def test_the_kv_capacity_is_stated_at_start(llama_folder, caplog):
    """One line says how many tokens the cache holds; a cache smaller than the context
    says that longer requests will be refused."""
    with caplog.at_level("INFO", logger="tandem.worker"):
        LLM(llama_folder, num_blocks=3, block_size=4, max_model_len=64)
    assert "KV cache: 12 tokens (3 blocks of 4, " in caplog.text
    assert "holds 12 tokens, fewer than the context of 64" in caplog.text


def test_a_kv_cache_that_cannot_fit_is_refused_at_start(llama_folder, monkeypatch):
    """A pool larger than the memory available after the weights is refused before it
    is allocated, naming the setting; without one, the default budget shrinks to 80%
    of what is available instead."""
    from tandem.runner import kv_cache

    monkeypatch.setattr(kv_cache, "host_available_bytes", lambda: 1 << 20)
    with pytest.raises(InvalidParameterError, match=r"kv_cache_memory.*does not fit: 0\.00 GiB"):
        LLM(llama_folder, kv_cache_memory=64 << 20, max_model_len=64)
    with pytest.raises(InvalidParameterError, match="num_blocks"):
        LLM(llama_folder, num_blocks=100_000, max_model_len=64)
    llm = LLM(llama_folder, max_model_len=64, max_num_seqs=64)
    per_block = kv_cache.kv_bytes_per_block(
        llm.engine.executor.runner.model.config, 16, torch.float32, "auto"
    )
    assert llm.engine.executor.info.num_blocks == int((1 << 20) * 0.8 // per_block)


def test_the_default_pool_holds_a_full_batch_of_full_length_sequences(llama_folder):
    """Capped by what the settings can use, the pool still holds max_num_seqs sequences
    of max_model_len tokens when that length is not a whole number of blocks (each
    sequence takes whole blocks): they all run together, none preempted."""
    llm = LLM(llama_folder, max_model_len=38, max_num_seqs=4, max_num_batched_tokens=256)
    assert llm.engine.executor.info.num_blocks == 4 * 3  # 38 tokens: 3 blocks of 16
    preempted = []
    schedule = llm.engine.scheduler.schedule

    def watched():
        out = schedule()
        preempted.extend(out.preempted_ids)
        return out

    llm.engine.scheduler.schedule = watched
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i] * 30} for i in range(4)]
    llm.generate(prompts, params, use_tqdm=False)
    assert preempted == []


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_prompt_of_thousands_of_tokens_decodes_as_transformers(model_dirs, arch):
    """5,000 prompt tokens in chunks of 2,048 (the later ones attend to a long prefix
    through the split path, Mistral's sliding window through the masked one), then
    greedy decoding over that context: the tokens transformers' generate gives."""
    folder, hf_model = model_dirs(arch, max_position_embeddings=8192)
    ids = torch.randint(2, VOCAB_SIZE, (5000,), generator=torch.Generator().manual_seed(5))
    prompt = ids.tolist()
    expected = reference_greedy(hf_model, [prompt], 6)[0]
    llm = LLM(folder, max_model_len=5016, max_num_batched_tokens=2048, max_num_seqs=2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == expected
