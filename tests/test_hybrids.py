"""Every hybrid family (recurrent layers beside attention: Qwen3.5's Gated DeltaNet,
LFM2's short convolutions) and the state cache, beyond the shared family tests
(test_models_match_hf): the convolution against one whole convolution, the whole engine
against transformers under chunking, batching, preemption, fewer state slots than
requests and speculation (states rolled back), the planner against the engine's
allocation, perplexity windows against transformers, and what a hybrid cannot do
refused or turned off."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.state_slots import StateSlots
from tandem.errors import InvalidParameterError
from tandem.kernels.causal_conv import causal_conv, causal_conv_step
from tandem.models.loader import load_model
from tests.hf_models import VOCAB_SIZE, assert_close, reference_greedy, reference_logits

HYBRIDS = ["qwen3_5", "qwen3_next", "lfm2", "lfm2_moe", "granite_hybrid"]


@pytest.mark.unit
def test_causal_conv_with_state_equals_one_convolution():
    """A sequence convolved in chunks (its state carried) and then token by token in a
    slot equals one causal convolution over all of it."""
    channels, width, length = 10, 4, 23
    x = torch.randn(length, channels, dtype=torch.float64)
    weight = torch.randn(channels, width, dtype=torch.float64)
    ref = F.conv1d(x.t()[None], weight[:, None, :], padding=width - 1, groups=channels)[0]
    ref = ref[:, :length].t()
    state = torch.zeros(channels, width - 1, dtype=torch.float64)
    first, state = causal_conv(x[:9], weight, state)
    second, state = causal_conv(x[9:20], weight, state)
    states = torch.zeros(3, channels, width - 1, dtype=torch.float32)
    states[2] = state
    slot = torch.tensor([2])
    steps = [causal_conv_step(x[t : t + 1], weight, states, slot) for t in (20, 21, 22)]
    got = torch.cat([first, second, *steps])
    assert (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=16, long_prefill_token_threshold=0),  # chunks of 16
        dict(max_num_batched_tokens=24, block_size=4, num_blocks=26),  # preemption
        dict(state_slots=2, num_blocks=40),  # two state slots for five requests
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "disable_by_batch_size": None}),  # states rolled back
        dict(speculative_config={"method": "eagle", "num_speculative_tokens": 2,
                                 "disable_by_batch_size": None}),  # a head over the hybrid
    ],
    ids=["chunked", "preempted", "two-slots", "ngram-speculation", "eagle-speculation"],
)  # fmt: skip
@pytest.mark.parametrize("arch", HYBRIDS)
def test_the_engine_gives_transformers_greedy_tokens(model_dirs, eagle_heads, arch, options):
    """Through the whole engine: prompts cut into chunks (each carrying its state to
    the next), requests preempted and recomputed in whatever slot is free, more
    requests than slots (admission waits for one), and n-gram drafts verified (each
    slot rolled back to its last accepted token) give transformers' tokens, and every
    slot and block comes back."""
    from tandem import LLM, SamplingParams

    folder, hf_model = model_dirs(arch)
    if "state_slots" in options:  # a budget whose half holds two slots (split_budget)
        per_slot = load_model(folder).config.state_bytes_per_sequence()
        options = {**options, "kv_cache_memory": 5 * per_slot}
        del options["state_slots"]
    rng = random.Random(5)
    motif = [rng.randrange(VOCAB_SIZE) for _ in range(4)]  # (something for n-grams to find)
    lengths = (40, 3, 67, 1, 18)
    prompts = [motif * 3 + [rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in lengths]
    if options.get("speculative_config", {}).get("method") == "eagle":
        options = {"speculative_config": {**options["speculative_config"],
                                          "model": eagle_heads(folder)}}  # fmt: skip
    llm = LLM(str(folder), **options)
    # (long enough for this model's outputs to repeat themselves: drafts accepted in part)
    new = 40 if "speculative_config" in options else 10
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_greedy(hf_model, prompts, new)
    slots = llm.engine.state_slots
    if "block_size" in options:
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
    if "kv_cache_memory" in options:
        assert slots.num_slots == 2
    spec = llm.engine.spec_stats
    if "speculative_config" in options:  # drafts verified (n-grams: some accepted, some not)
        assert spec.num_drafts > 0
        if options["speculative_config"]["method"] == "ngram":
            assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert not llm.engine.kv_manager.enable_prefix_caching  # (a state is not a prefix)
    slots.check_no_leaks()
    llm.engine.kv_manager.check_no_leaks()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_layer_skipping_drafts_and_disaggregation_are_refused(model_dirs, arch):
    """A draft that skips layers would leave their states without its tokens; another
    instance's K/V would come without the states: both refused by name."""
    from tandem import LLM

    folder, _ = model_dirs(arch)
    with pytest.raises(InvalidParameterError, match="speculative"):
        LLM(str(folder), speculative_config={"method": "layer_skip",
                                             "num_speculative_tokens": 2})  # fmt: skip
    llm = LLM(str(folder))
    with pytest.raises(InvalidParameterError, match="kv_transfer_config"):
        llm.engine.set_kv_connector(object())


@pytest.mark.unit
def test_state_slots_are_taken_and_given_back():
    slots = StateSlots(3)
    assert [slots.take(r) for r in "abc"] == [0, 1, 2] and slots.num_free == 0
    slots.give_back("b")
    assert slots.take("d") == 1
    for r in "acd":
        slots.give_back(r)
    slots.give_back("a")  # (twice: nothing more)
    slots.check_no_leaks()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_the_planner_sizes_a_hybrid_as_the_engine_allocates(model_dirs, arch):
    """``tandem plan``'s capacity for this machine's CPU engine is the engine's own
    allocation (its KV blocks and its state slots), and its decode floor reads each
    sequence's states once a step beside the weights."""
    from tandem import LLM
    from tandem.plan.calculator import plan
    from tandem.plan.hardware import Hardware

    folder, _ = model_dirs(arch)
    hardware = Hardware("test", memory_gb=8.0, bandwidth_gbs=10.0, tflops={"fp32": 0.1})
    result = plan(folder, hardware, "fp32", None, 64, 64, batch=4, engine_cpu=True)
    llm = LLM(str(folder))
    engine = llm.engine
    assert result["max_kv_tokens"] == engine.kv_manager.num_blocks * engine.kv_manager.block_size
    assert result["max_sequences"] == min(engine.state_slots.num_slots,
                                          result["max_kv_tokens"] // 128)  # fmt: skip
    state = result["state_bytes_per_sequence"]
    assert state == load_model(folder).config.state_bytes_per_sequence() > 0
    # The floor: weights and 4 sequences' states, and 4 x 96 tokens of K/V (the mean
    # context of 64 + 64 / 2), at 10 GB/s.
    weights_and_states = result["weight_bytes_read_per_step"] + 4 * state
    kv = 4 * (64 + 32) * result["kv_bytes_per_token"]
    assert result["decode_step_floor_s"] == pytest.approx((weights_and_states + kv) / 10e9)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_perplexity_windows_score_a_hybrid_as_transformers(model_dirs, arch):
    """``tandem eval perplexity``'s windows run on a slot of their own (each from empty
    states), in chunks that carry the states, and score as transformers does."""
    from tandem import LLM
    from tandem.eval.windows import score_windows

    folder, hf_model = model_dirs(arch)
    llm = LLM(str(folder))
    tokens = random.Random(3).choices(range(VOCAB_SIZE), k=200)
    for scored in score_windows(llm, tokens, 64, batch=24):
        ref = reference_logits(hf_model, scored.tokens).log_softmax(-1)[32:63]
        assert_close(scored.log_probs, ref)
    llm.engine.state_slots.check_no_leaks()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_bfloat16_close_to_transformers_bfloat16(model_dirs, arch):
    """In bfloat16 a prompt and its decode steps (the compiled float32 steps stand
    aside; the states stay float32) stay within bfloat16's error of transformers'."""
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    folder, hf_model = model_dirs(arch)
    loaded = load_model(folder, dtype="bfloat16")
    hf_bf16 = type(hf_model)(hf_model.config).eval()
    hf_bf16.load_state_dict(hf_model.state_dict())
    hf_bf16 = hf_bf16.to(torch.bfloat16)
    ids = list(range(5, 45))
    runner = ModelRunner(loaded, 8, 16, num_state_slots=1)
    prompt = runner.forward([SequenceChunk(ids[:-2], 0, [0, 1, 2], state_slot=0)], all_logits=True)
    steps = [
        runner.forward([SequenceChunk([t], len(ids) - 2 + i, [0, 1, 2], state_slot=0)])
        for i, t in enumerate(ids[-2:])
    ]
    assert_close(torch.cat([prompt, *steps]), reference_logits(hf_bf16, ids), rel=5e-2)
