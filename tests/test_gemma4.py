"""Gemma 4 beyond the shared family tests (test_models_match_hf): the published configs
parsed as transformers reads them, a cache whose layers differ in shape (and layers
that keep none), the whole engine against transformers under chunking, preemption,
prefix reuse and speculation, the planner against the engine's allocation, bfloat16."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from tandem.models.gemma4 import parse_gemma4_config
from tandem.models.loader import load_model
from tandem.runner.kv_cache import LayeredKVCache, allocate_kv_cache, kv_bytes_per_block
from tests.hf_models import VOCAB_SIZE, assert_close, reference_greedy, reference_logits

SLIDING, FULL = "sliding_attention", "full_attention"
# google/gemma-4-E2B-it's text_config (its vision and audio configs left out).
E2B = dict(
    architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", eos_token_id=[1, 106],
    text_config=dict(
        model_type="gemma4_text", hidden_size=1536, intermediate_size=6144,
        num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        global_head_dim=512, sliding_window=512, vocab_size=262144,
        vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
        num_kv_shared_layers=20, use_double_wide_mlp=True, final_logit_softcapping=30.0,
        layer_types=([SLIDING] * 4 + [FULL]) * 7, rms_norm_eps=1e-6,
        max_position_embeddings=131072, tie_word_embeddings=True,
    ),
)  # fmt: skip
# google/gemma-4-31B-it's: no per-layer inputs; full layers with 4 KV heads of 512 whose
# values are their keys.
G31B = dict(
    architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4",
    text_config=dict(
        model_type="gemma4_text", hidden_size=5376, intermediate_size=21504,
        num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
        global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
        sliding_window=1024, vocab_size=262144, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, final_logit_softcapping=30.0,
        layer_types=([SLIDING] * 5 + [FULL]) * 10, max_position_embeddings=262144,
    ),
)  # fmt: skip


def transformers_view(published: dict) -> transformers.Gemma4TextConfig:
    return transformers.Gemma4TextConfig(**published["text_config"])


@pytest.mark.unit
@pytest.mark.parametrize("published", [E2B, G31B], ids=["E2B", "31B"])
def test_the_published_configs_parse_as_transformers_reads_them(published):
    """Which layers keep K/V and which read whose (transformers' kv_sharing_modes), each
    kind's heads, the MLPs' widths, and the cache bytes a token takes: K and V of the
    layers that keep them, each in its own shape."""
    config = parse_gemma4_config(published)
    reference = transformers_view(published)
    modes = reference.kv_sharing_modes
    assert list(config.kv_layers) == [i for i, m in enumerate(modes) if m != "reuse"]
    for layer, source in config.kv_shared_layers.items():
        assert modes[layer] == "reuse" and modes[source] == "store"
        assert reference.layer_types[source] == reference.layer_types[layer]
    shapes = []
    for layer in config.kv_layers:
        per_layer = reference.per_layer_config[layer]
        shapes.append((per_layer.num_key_value_heads, per_layer.head_dim))
        assert config.kv_shape(layer) == shapes[-1]
    assert config.kv_bytes_per_token(2) == sum(2 * h * d * 2 for h, d in shapes)
    text = published["text_config"]
    if published.get("eos_token_id"):  # (the whole model's, not its text config's 1)
        assert config.eos_token_ids == (1, 106)
    assert config.family_options["per_layer_input_size"] == text["hidden_size_per_layer_input"]
    assert config.rope.rotary_dim == 512 and config.family_options["local_rope"].rotary_dim == 256
    assert config.layer_windows().count(None) == text["layer_types"][: len(config.kv_layers)].count(
        FULL
    )


@pytest.mark.unit
def test_a_cache_of_layers_in_several_shapes_moves_blocks_whole():
    """Each cache place a view of one region in its own shape; a block read from one
    cache and written into another lands in every layer's rows (as KV transfer moves
    them)."""
    config = parse_gemma4_config(E2B)
    cache = allocate_kv_cache(config, 6, 4, torch.float32, torch.device("cpu"))
    assert isinstance(cache, LayeredKVCache) and len(cache) == 15
    assert tuple(cache[4].shape) == (2, 6, 4, 1, 512) and tuple(cache[0].shape) == (2, 6, 4, 1, 256)
    assert cache.flat.numel() * 4 == kv_bytes_per_block(config, 4, torch.float32) * 6
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape))
    other = allocate_kv_cache(config, 6, 4, torch.float32, torch.device("cpu"))
    other.write(torch.tensor([5, 0]), cache.read(torch.tensor([1, 3])))
    for mine, theirs in zip(cache.layers, other.layers, strict=True):
        assert torch.equal(theirs[:, 5], mine[:, 1]) and torch.equal(theirs[:, 0], mine[:, 3])
        assert not theirs[:, 2].any()
    int8 = allocate_kv_cache(config, 6, 4, torch.float32, torch.device("cpu"), "int8")
    assert int8.flat.numel() == kv_bytes_per_block(config, 4, torch.float32, "int8") * 6


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=16, long_prefill_token_threshold=0),  # chunks of 16
        dict(max_num_batched_tokens=24, block_size=4, num_blocks=26),  # preemption
        dict(enable_prefix_caching=True, block_size=4),  # shared prefixes reused
        dict(kv_cache_dtype="bfloat16"),  # rows stored in another type
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "disable_by_batch_size": None}),  # drafts verified
    ],
    ids=["chunked", "preempted", "prefix-cached", "bf16-cache", "ngram-speculation"],
)  # fmt: skip
def test_the_engine_gives_transformers_greedy_tokens(model_dirs, options):
    """Through the whole engine: prompts in chunks, requests preempted and recomputed,
    prefixes served from the cache (the layers that read another's K/V read the cached
    rows), and n-gram drafts verified, give transformers' tokens."""
    from tandem import LLM, SamplingParams

    folder, hf_model = model_dirs("gemma4")
    rng = random.Random(5)
    motif = [rng.randrange(VOCAB_SIZE) for _ in range(4)]
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(21)]  # (a prefix some prompts share)
    lengths = (40, 3, 67, 1, 18)
    prompts = [motif * 3 + [rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in lengths]
    prompts += [shared + [rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (9, 30)]
    llm = LLM(str(folder), **options)
    new = 40 if "speculative_config" in options else 10
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    # (the prefixes cached by the first call, read by the second)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:-1]], params, use_tqdm=False)
    last = llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in [*first, *last]]
    expected = reference_greedy(hf_model, prompts, new)
    if options.get("kv_cache_dtype") == "bfloat16":  # (rounded rows: most tokens agree)
        pairs = [
            (a, b) for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True)
        ]
        same = sum(a == b for a, b in pairs)
        assert same >= 0.9 * sum(map(len, expected))
    else:
        assert got == expected
    if "block_size" in options and "num_blocks" in options:
        assert sum(o.metrics.num_preemptions for o in first) > 0
    if options.get("enable_prefix_caching"):
        assert last[0].num_cached_tokens >= 20
    if "speculative_config" in options:
        spec = llm.engine.spec_stats
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    llm.engine.kv_manager.check_no_leaks()


def test_full_layers_with_their_own_values_and_no_per_layer_inputs(model_dirs):
    """The 31B's kind: no per-layer inputs, full layers with values of their own and as
    many KV heads as the sliding ones (one cache shape... but for the head size)."""
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    folder, hf_model = model_dirs(
        "gemma4", attention_k_eq_v=False, hidden_size_per_layer_input=0, num_kv_shared_layers=0
    )
    loaded = load_model(folder)
    assert not loaded.config.kv_shared_layers and len(loaded.config.kv_layers) == 5
    ids = [random.Random(2).randrange(VOCAB_SIZE) for _ in range(30)]
    runner = ModelRunner(loaded, 4, 16)
    ours = runner.forward([SequenceChunk(ids[:-1], 0, [0, 1])], all_logits=True)
    step = runner.forward([SequenceChunk(ids[-1:], len(ids) - 1, [0, 1])])
    assert_close(torch.cat([ours, step]), reference_logits(hf_model, ids))


def test_the_planner_sizes_the_cache_as_the_engine_allocates(model_dirs):
    """``tandem plan``'s K/V bytes a token are the layers that keep K/V, each in its
    own shape; its capacity for this machine's CPU engine is the engine's."""
    from tandem import LLM
    from tandem.plan.calculator import plan
    from tandem.plan.hardware import Hardware

    folder, _ = model_dirs("gemma4")
    hardware = Hardware("test", memory_gb=8.0, bandwidth_gbs=10.0, tflops={"fp32": 0.1})
    result = plan(folder, hardware, "fp32", None, 64, 64, batch=4, engine_cpu=True)
    # layers 0, 1 (2 KV heads of 16), 2 (1 of 32); 3 and 4 read 1's and 2's
    assert result["kv_bytes_per_token"] == 2 * 4 * (2 * 16 + 2 * 16 + 1 * 32)
    engine = LLM(str(folder)).engine
    assert result["max_kv_tokens"] == engine.kv_manager.num_blocks * engine.kv_manager.block_size


def test_bfloat16_close_to_transformers_bfloat16(model_dirs):
    """A prompt and its decode steps in bfloat16 differ from transformers' bfloat16 by
    no more than transformers' bfloat16 differs from its float32 (unscaled scores of
    normed queries and keys make this family's rounding error large: 11% here)."""
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    folder, hf_model = model_dirs("gemma4")
    loaded = load_model(folder, dtype="bfloat16")
    hf_bf16 = type(hf_model)(hf_model.config).eval()
    hf_bf16.load_state_dict(hf_model.state_dict())
    hf_bf16 = hf_bf16.to(torch.bfloat16)
    ids = list(range(5, 45))
    runner = ModelRunner(loaded, 8, 16)
    prompt = runner.forward([SequenceChunk(ids[:-2], 0, [0, 1, 2])], all_logits=True)
    steps = [
        runner.forward([SequenceChunk([t], len(ids) - 2 + i, [0, 1, 2])])
        for i, t in enumerate(ids[-2:])
    ]
    ours, theirs = torch.cat([prompt, *steps]), reference_logits(hf_bf16, ids)
    own_error = (theirs - reference_logits(hf_model, ids)).abs().max()
    assert (ours - theirs).abs().max() <= own_error


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_gguf_files_written_for_llama_cpp_read_back(tmp_path, model_dirs, fmt):
    """A gemma4 GGUF file as llama.cpp's converter lays it out (KV heads and MLP widths
    per layer, each kind's head size, which layers slide, the shared layers without K/V
    tensors, rope_freqs marking the full layers' turning pairs) reads back to
    transformers' logits: exactly from float32, within the quantization's error from
    Q8_0."""
    from tandem.models.gguf_export import export_gguf
    from tandem.models.gguf_file import GGUFFile
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    folder, hf_model = model_dirs("gemma4")
    path = export_gguf(folder, tmp_path / f"gemma4-{fmt}.gguf", fmt)
    file = GGUFFile(path)
    fields, tensors = file.fields, {t.name for t in file.tensors}
    assert fields["general.architecture"] == "gemma4"
    assert list(fields["gemma4.attention.head_count_kv"]) == [2, 2, 1, 2, 1]
    assert list(fields["gemma4.feed_forward_length"]) == [128, 128, 128, 256, 256]
    assert list(fields["gemma4.attention.sliding_window_pattern"]) == [1, 1, 0, 1, 0]
    assert (fields["gemma4.attention.key_length"], fields["gemma4.attention.key_length_swa"]) == (
        32,
        16,
    )
    assert fields["gemma4.attention.shared_kv_layers"] == 2
    assert "blk.3.attn_k.weight" not in tensors and "blk.2.attn_v.weight" not in tensors
    assert {"per_layer_token_embd.weight", "blk.0.layer_output_scale.weight"} <= tensors
    assert torch.equal(
        torch.from_numpy(file.data(next(t for t in file.tensors if t.name == "rope_freqs.weight")))
        .view(torch.float32)[:6], torch.tensor([1.0, 1.0, 1.0, 1.0, 1e30, 1e30])
    )  # fmt: skip
    # A decode step reads a row of the per-layer table, as of the token embedding; the
    # tied embedding whole, as the LM head (tandem plan's bytes a step).
    from tandem.plan.calculator import file_weights

    table = next(t for t in file.tensors if t.name == "per_layer_token_embd.weight")
    file.close()
    weights = file_weights(path)
    assert weights.held_bytes - weights.read_per_token == table.nbytes  # (float: as stored)
    loaded = load_model(path)
    assert loaded.config.kv_shared_layers == {3: 1, 4: 2}
    ids = list(range(5, 60))
    runner = ModelRunner(loaded, 4, 16)
    ours = runner.forward([SequenceChunk(ids, 0, [0, 1, 2, 3])], all_logits=True)
    reference = reference_logits(hf_model, ids)
    if fmt == "f32":
        assert_close(ours, reference)
        return
    # Q8_0: its kernels quantize the activations to 8 bits too (as llama.cpp's do), and
    # this family's unscaled scores amplify rounding (test_bfloat16...): within twice
    # transformers' own bfloat16 error.
    hf_bf16 = type(hf_model)(hf_model.config).eval()
    hf_bf16.load_state_dict(hf_model.state_dict())
    own_error = (reference_logits(hf_bf16.to(torch.bfloat16), ids) - reference).abs().max()
    assert (ours - reference).abs().max() <= 2 * own_error


def test_the_mixture_layers_through_the_engine(model_dirs):
    """26B-A4B's kind (a mixture beside each layer's MLP, routed from the stream, each
    expert's output scaled): prompts in chunks, preempted and recomputed, give
    transformers' greedy tokens; the experts' load is counted."""
    from tandem import LLM, SamplingParams

    folder, hf_model = model_dirs("gemma4_moe")
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in (33, 5, 50)]
    llm = LLM(str(folder), max_num_batched_tokens=16, block_size=4, num_blocks=30)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_greedy(hf_model, prompts, 10)
    runner = llm.engine.executor.runner
    assert len(runner.moe_layers) == 3 and sum(runner.moe_layers[0].expert_load) > 0
    llm.engine.kv_manager.check_no_leaks()


def test_a_mixture_gguf_file_reads_back(tmp_path, model_dirs):
    """26B-A4B's kind as llama.cpp's gemma4 holds it: the experts stacked (each read as
    its own gate and up rows), the router with its scale (ffn_gate_inp.scale), each
    expert's output scale (ffn_down_exps.scale): transformers' logits from float32."""
    from tandem.models.gguf_export import export_gguf
    from tandem.models.gguf_file import GGUFFile
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    folder, hf_model = model_dirs("gemma4_moe")
    path = export_gguf(folder, tmp_path / "gemma4-moe.gguf", "f32")
    file = GGUFFile(path)
    names = {t.name for t in file.tensors}
    assert {"blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale", "blk.0.ffn_gate_exps.weight",
            "blk.2.post_ffw_norm_2.weight"} <= names  # fmt: skip
    assert file.fields["gemma4.expert_used_count"] == 2
    file.close()
    loaded = load_model(path)
    assert loaded.config.moe.num_experts == 6
    ids = list(range(5, 50))
    ours = ModelRunner(loaded, 4, 16).forward([SequenceChunk(ids, 0, [0, 1, 2])], all_logits=True)
    assert_close(ours, reference_logits(hf_model, ids))


def test_a_quantized_mixture_runs_its_experts_in_one_call(tmp_path, model_dirs):
    """A Q8_0 file's mixtures get the fused experts' call (routed from the stream's
    logits, each expert's output scale applied in the kernel): the same logits as each
    expert run on its own."""
    from tandem.models.gguf_export import export_gguf
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    folder, _ = model_dirs("gemma4_moe", moe_intermediate_size=64)  # (whole Q8_0 blocks)
    path = export_gguf(folder, tmp_path / "gemma4-moe-q8.gguf", "q8_0")
    ids = list(range(5, 40))
    runner = ModelRunner(load_model(path), 4, 16)
    assert all(getattr(m, "fused_experts", None) is not None for m in runner.moe_layers)
    fused = runner.forward([SequenceChunk(ids, 0, [0, 1, 2])], all_logits=True)
    step = runner.forward([SequenceChunk([7], len(ids), [0, 1, 2])])
    for layer in runner.moe_layers:
        del layer.fused_experts
    loop = runner.forward([SequenceChunk(ids, 0, [0, 1, 2])], all_logits=True)
    assert_close(fused, loop, 1e-5)
    assert_close(step, runner.forward([SequenceChunk([7], len(ids), [0, 1, 2])]), 1e-5)
