"""LFM2 beyond the shared family tests (test_models_match_hf) and the hybrids'
(test_hybrids): the published config.json's spelling parsed as transformers reads it,
and GGUF files as llama.cpp's converter lays them out read back to transformers'
logits."""

from __future__ import annotations

import pytest
import transformers

from tandem.errors import ModelLoadError
from tandem.models.lfm2 import parse_lfm2_config
from tandem.models.loader import load_model
from tests.hf_models import assert_close, reference_logits

# LiquidAI/LFM2-1.2B's config.json (its older spelling: block_ff_dim, full_attn_idxs,
# tie_embedding).
PUBLISHED = dict(
    architectures=["Lfm2ForCausalLM"], model_type="lfm2", vocab_size=65536, hidden_size=2048,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, block_ff_dim=12288,
    block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
    full_attn_idxs=[2, 5, 8, 10, 12, 14], conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
    rope_theta=1000000.0, tie_embedding=True, max_position_embeddings=128000,
)  # fmt: skip


@pytest.mark.unit
def test_the_published_config_parses_as_transformers_reads_it():
    """The MLP's width as Lfm2MLP adjusts it, the layers that attend, tied embeddings;
    the state a sequence holds: the two last inputs of each channel in every
    convolution layer."""
    config = parse_lfm2_config(PUBLISHED)
    reference = transformers.Lfm2Config(**PUBLISHED)
    narrow = transformers.Lfm2Config(**{**PUBLISHED, "hidden_size": 8})  # (a small MLP)
    mlp = transformers.models.lfm2.modeling_lfm2.Lfm2MLP(narrow)
    assert config.intermediate_size == mlp.w1.out_features == 8192
    attending = [i for i, kind in enumerate(reference.layer_types) if kind == "full_attention"]
    assert list(config.kv_layers) == attending == PUBLISHED["full_attn_idxs"]
    assert config.tie_word_embeddings and config.rope.theta == 1e6 and config.norm_eps == 1e-5
    assert config.head_dim == 64 and config.num_kv_heads == 8
    assert config.state_bytes_per_sequence() == 10 * 2048 * 2 * 4


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_gguf_files_written_for_llama_cpp_read_back(tmp_path, model_dirs, fmt):
    """An lfm2 GGUF file as llama.cpp's converter lays it out (head_count_kv per layer, 0
    where a layer convolves; the final norm as token_embd_norm; the taps [hidden, 3]
    float32; the LM head tied) reads back to transformers' logits: exactly from float32,
    within the quantization's error from Q8_0."""
    from tandem.models.gguf_export import export_gguf
    from tandem.models.gguf_file import GGUFFile
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    folder, hf_model = model_dirs("lfm2", tie_word_embeddings=True)
    path = export_gguf(folder, tmp_path / f"lfm2-{fmt}.gguf", fmt)
    file = GGUFFile(path)
    tensors = {t.name: t for t in file.tensors}
    assert file.fields["general.architecture"] == "lfm2"
    attending = [kind == "full_attention" for kind in hf_model.config.layer_types]
    assert list(file.fields["lfm2.attention.head_count_kv"]) == [2 * a for a in attending]
    assert file.fields["lfm2.shortconv.l_cache"] == 3
    assert file.fields["lfm2.feed_forward_length"] == 96
    assert "token_embd_norm.weight" in tensors and "output_norm.weight" not in tensors
    assert "output.weight" not in tensors  # (tied)
    taps = tensors["blk.0.shortconv.conv.weight"]
    assert (tuple(taps.shape), taps.type) == ((3, 64), 0)  # [hidden, 3] in ggml's order, F32
    assert {"blk.0.shortconv.in_proj.weight", "blk.1.attn_q_norm.weight"} <= set(tensors)
    file.close()
    loaded = load_model(path)
    assert loaded.config.kv_layers == (1, 4) and loaded.config.tie_word_embeddings
    ids = list(range(5, 60))
    runner = ModelRunner(loaded, 4, 16, num_state_slots=1)
    ours = runner.forward([SequenceChunk(ids, 0, [0, 1, 2, 3], state_slot=0)], all_logits=True)
    assert_close(ours, reference_logits(hf_model, ids), 1e-4 if fmt == "f32" else 3e-2)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_whole_layer_decode_equals_the_layer_by_layer_path(
    tmp_path, model_dirs, monkeypatch, speculative
):
    """On quantized weights a decode step runs each convolution layer (and Llama's
    attention layers) in one compiled call: tokens and logprobs equal the layer-by-layer
    path's bit for bit; with n-gram drafts (verification runs the layers their own way,
    rolling the windows back) the tokens equal decoding without them."""
    from tandem import LLM, SamplingParams
    from tandem.models.gguf_export import export_gguf
    from tandem.runner.fused_decode import FusedDecode

    folder, _ = model_dirs("lfm2")
    path = str(export_gguf(folder, tmp_path / "lfm2-q8_0.gguf", "q8_0"))
    whole = []
    original = FusedDecode.short_conv_layer

    def counted(self, layer, h, residual, batch):
        out = original(self, layer, h, residual, batch)
        whole.append(out is not None)
        return out

    monkeypatch.setattr(FusedDecode, "short_conv_layer", counted)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8] * 5, [11, 12, 13] * 7, [40])]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}

    def run(flag: str, speculative_config=None):
        monkeypatch.setenv("TANDEM_FUSED_DECODE", flag)
        llm = LLM(path, max_num_seqs=4, speculative_config=speculative_config)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    fused = run("1", spec if speculative else None)
    assert any(whole)
    if speculative:
        assert [t for t, _ in fused] == [t for t, _ in run("1")]
    else:
        assert fused == run("0")


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_lfm2_moe_gguf_files_read_back(tmp_path, model_dirs, fmt):
    """An lfm2moe file (its first layer dense, leading_dense_block_count; sigmoid gating;
    the selection bias as exp_probs_b; experts stacked) reads back to transformers'
    logits: exactly from float32, within the quantization's error from Q8_0 (the
    routed_scaling_factor 1, as llama.cpp's graph has none: other values are refused)."""
    from tandem.models.gguf_export import export_gguf
    from tandem.models.gguf_file import GGUFFile
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    with pytest.raises(ModelLoadError, match="routed_scaling_factor"):
        export_gguf(model_dirs("lfm2_moe")[0], tmp_path / "scaled.gguf", fmt)
    folder, hf_model = model_dirs("lfm2_moe", routed_scaling_factor=1.0)
    path = export_gguf(folder, tmp_path / f"lfm2moe-{fmt}.gguf", fmt)
    file = GGUFFile(path)
    names = {t.name for t in file.tensors}
    assert file.fields["general.architecture"] == "lfm2moe"
    assert file.fields["lfm2moe.leading_dense_block_count"] == 1
    assert file.fields["lfm2moe.expert_gating_func"] == 2
    assert {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_exps.weight", "blk.1.exp_probs_b.bias",
            "blk.1.ffn_gate_inp.weight"} <= names  # fmt: skip
    file.close()
    loaded = load_model(path)
    assert loaded.config.moe.dense_layers == (0,) and loaded.config.moe.scoring == "sigmoid"
    ids = list(range(5, 60))
    runner = ModelRunner(loaded, 4, 16, num_state_slots=1)
    ours = runner.forward([SequenceChunk(ids, 0, [0, 1, 2, 3], state_slot=0)], all_logits=True)
    assert_close(ours, reference_logits(hf_model, ids), 1e-4 if fmt == "f32" else 8e-2)
