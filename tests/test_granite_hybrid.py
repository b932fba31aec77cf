"""Granite 4.0-H beyond the shared family tests (test_models_match_hf) and the hybrids'
(test_hybrids): Mamba-2's SSD against its recurrent definition (float64, brute force),
the published config.json parsed, and GGUF files as llama.cpp's converter lays them out
read back to transformers' logits."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.ssd import chunked_ssd, ssd_step
from tandem.models.granite_hybrid import parse_granite_hybrid_config
from tandem.models.loader import load_model
from tests.hf_models import assert_close, reference_logits


def recurrent_ssd(x, dt, A, B, C, state):
    """S_t = exp(dt_t A) S + B_t (dt_t x_t)^T, y_t = S_t^T C_t, token by token."""
    S, out = state.clone(), []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * A)[:, None, None]
        S = decay * S + B[t][:, :, None] * (dt[t][:, None] * x[t])[:, None, :]
        out.append(torch.einsum("hnp,hn->hp", S, C[t]))
    return torch.stack(out), S


def ssd_inputs(length, heads=3, n=5, p=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, p, generator=g, dtype=torch.float64)
    dt = torch.rand(length, heads, generator=g, dtype=torch.float64) * 0.5
    A = -torch.rand(heads, generator=g, dtype=torch.float64) * 2
    B = torch.randn(length, heads, n, generator=g, dtype=torch.float64)
    C = torch.randn(length, heads, n, generator=g, dtype=torch.float64)
    state = torch.randn(heads, n, p, generator=g, dtype=torch.float64)
    return x, dt, A, B, C, state


@pytest.mark.unit
@pytest.mark.parametrize("length", [1, 7, 64, 65, 300, 8192])
def test_chunked_ssd_equals_the_recurrence(length):
    """From a nonzero state, in chunks or cut anywhere (the state carried), the chunked
    form gives the recurrence's outputs and final state."""
    x, dt, A, B, C, state = ssd_inputs(length)
    ref, ref_state = recurrent_ssd(x, dt, A, B, C, state)
    cut = length // 3
    first, mid = chunked_ssd(x[:cut], dt[:cut], A, B[:cut], C[:cut], state)
    second, last = chunked_ssd(x[cut:], dt[cut:], A, B[cut:], C[cut:], mid)
    got = torch.cat([first, second])
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 1e-4 * scale
    assert (last - ref_state).abs().max() <= 1e-4 * ref_state.abs().max()


@pytest.mark.unit
def test_a_decode_step_runs_each_sequence_in_its_slot():
    """Three sequences' tokens in scattered slots: each as the recurrence, the other slots
    untouched."""
    x, dt, A, B, C, state = ssd_inputs(3, seed=1)
    states = torch.randn(6, *state.shape, dtype=torch.float32)
    before = states.clone()
    slots = torch.tensor([4, 0, 2])
    got = ssd_step(x, dt, A, B, C, states, slots)
    for s, slot in enumerate(slots.tolist()):
        one = slice(s, s + 1)
        ref, ref_state = recurrent_ssd(x[one], dt[one], A, B[one], C[one], before[slot].double())
        assert (got[s] - ref[0]).abs().max() < 1e-5
        assert (states[slot].double() - ref_state).abs().max() < 1e-5
    assert torch.equal(states[[1, 3, 5]], before[[1, 3, 5]])


# Shaped as ibm-granite/granite-4.0-h-tiny's config.json: 40 layers, 4 of them attention.
TINY = dict(
    architectures=["GraniteMoeHybridForCausalLM"], vocab_size=100352, hidden_size=1536,
    num_hidden_layers=40, num_attention_heads=12, num_key_value_heads=4,
    intermediate_size=512, shared_intermediate_size=1024, num_local_experts=64,
    num_experts_per_tok=6, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128,
    mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True,
    mamba_proj_bias=False, position_embedding_type="nope", embedding_multiplier=12.0,
    residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=6.0,
    layer_types=(["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4,
)  # fmt: skip


@pytest.mark.unit
def test_the_published_config_parses():
    """Its four attention layers keep K/V; each sequence holds, per Mamba-2 layer, a conv
    window of the x B C channels and a [48, 128, 64] SSD state."""
    config = parse_granite_hybrid_config(TINY)
    assert config.kv_layers == (5, 15, 25, 35) and len(config.recurrent_layers) == 36
    assert config.recurrent_state == ((3072 + 256, 3), (48, 128, 64))
    assert (
        config.moe.num_experts == 64 and config.family_options["shared_intermediate_size"] == 1024
    )
    assert not config.family_options["rope"]
    assert config.state_bytes_per_sequence() == 36 * 4 * (3328 * 3 + 48 * 128 * 64)


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_gguf_files_written_for_llama_cpp_read_back(tmp_path, model_dirs, fmt):
    """A granitehybrid GGUF file as llama.cpp's converter lays it out (head_count_kv 0
    where a layer is Mamba-2, A and D as [H, 1], the norm per group, the experts and the
    shared MLP apart, the multipliers as its scales) reads back to transformers' logits:
    exactly from float32, within the quantization's error from Q8_0."""
    from tandem.models.gguf_export import export_gguf
    from tandem.models.gguf_file import GGUFFile
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    folder, hf_model = model_dirs("granite_hybrid")
    path = export_gguf(folder, tmp_path / f"granite-{fmt}.gguf", fmt)
    file = GGUFFile(path)
    tensors = {t.name: t for t in file.tensors}
    assert list(file.fields["granitehybrid.attention.head_count_kv"]) == [0, 2, 0, 0]
    assert file.fields["granitehybrid.logit_scale"] == pytest.approx(1.5)
    assert not file.fields["granitehybrid.rope.scaling.finetuned"]
    assert tuple(tensors["blk.0.ssm_a"].shape) == (1, 8) and tensors["blk.0.ssm_a"].type == 0
    assert tuple(tensors["blk.0.ssm_norm.weight"].shape) == (64, 2)  # ggml's [inner / G, G]
    assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_shexp.weight", "blk.0.ssm_d",
            "blk.0.ssm_conv1d.bias", "blk.1.attn_q.weight"} <= set(tensors)  # fmt: skip
    file.close()
    loaded = load_model(path)
    assert loaded.config.kv_layers == (1,)
    ids = list(range(5, 60))
    runner = ModelRunner(loaded, 4, 16, num_state_slots=1)
    ours = runner.forward([SequenceChunk(ids, 0, [0, 1, 2, 3], state_slot=0)], all_logits=True)
    assert_close(ours, reference_logits(hf_model, ids), 1e-4 if fmt == "f32" else 5e-2)
