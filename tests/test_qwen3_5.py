"""Qwen3.5 beyond the shared family tests (test_models_match_hf) and the hybrids'
(test_hybrids): the delta rule against its recurrent definition (float64, brute force)
and its decode step in one compiled call against the torch ops, the state budget's
arithmetic, the published vision-and-text folders read as text, and GGUF files as
llama.cpp's converter lays them out."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from tandem.kernels import cpu as cpu_kernels
from tandem.kernels.delta_rule import chunked_gated_delta_rule, gated_delta_rule_step
from tandem.models.gated_delta_net import delta_net_shapes
from tandem.models.loader import load_model
from tandem.models.qwen3_5 import parse_qwen3_5_config
from tandem.runner.state_cache import split_budget
from tests.hf_models import assert_close, reference_logits


def recurrent_delta_rule(q, k, v, g, beta, state):
    """The gated delta rule token by token, in float64: the definition."""
    S = state.double().clone()
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].double().exp()[:, None, None]
        predicted = (S * k[t].double()[..., None]).sum(-2)
        delta = (v[t].double() - predicted) * beta[t].double()[:, None]
        S = S + k[t].double()[..., None] * delta[:, None, :]
        out.append((S * q[t].double()[..., None]).sum(-2))
    return torch.stack(out), S


def delta_inputs(length, heads=2, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1)
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(length, heads, generator=gen) * 0.5
    beta = torch.rand(length, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.unit
@pytest.mark.parametrize("length", [1, 7, 64, 65, 300, 8192])
def test_chunked_delta_rule_equals_the_recurrence(length):
    """The chunked (WY) form, from a nonzero state, equals the token-by-token
    definition in float64, outputs and final state, up to 8k tokens (and a length that
    ends mid-chunk)."""
    q, k, v, g, beta, state = delta_inputs(length)
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
    ref_out, ref_final = recurrent_delta_rule(q, k, v, g, beta, state)
    assert (out.double() - ref_out).abs().max() < 1e-4
    assert (final.double() - ref_final).abs().max() < 1e-4
    # Cut anywhere, the second part continues from the first part's state.
    cut = length // 3
    first, middle = chunked_gated_delta_rule(*(x[:cut] for x in (q, k, v, g, beta)), state)
    second, last = chunked_gated_delta_rule(*(x[cut:] for x in (q, k, v, g, beta)), middle)
    assert (torch.cat([first, second]).double() - ref_out).abs().max() < 1e-4
    assert (last.double() - ref_final).abs().max() < 1e-4


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch"])
def test_decode_step_runs_each_sequence_in_its_slot(monkeypatch, compiled):
    """One batched step over sequences in scattered slots equals each one's recurrence,
    and leaves the other slots as they were: the compiled kernel and the torch ops."""
    if not compiled:
        monkeypatch.setattr(cpu_kernels, "available", lambda device, dtype: False)
    elif cpu_kernels.load() is None:
        pytest.skip("no compiled CPU kernels here")
    states = torch.randn(6, 2, 16, 8)
    before = states.clone()
    slots = torch.tensor([4, 1, 3])
    inputs = [delta_inputs(1, seed=s) for s in range(3)]
    q, k, v, g, beta = (torch.cat([x[i] for x in inputs]) for i in range(5))
    out = gated_delta_rule_step(q, k, v, g, beta, states, slots)
    for b, slot in enumerate(slots.tolist()):
        one = (x[b : b + 1] for x in (q, k, v, g, beta))
        ref_out, ref_state = recurrent_delta_rule(*one, before[slot])
        assert (out[b].double() - ref_out[0]).abs().max() < 1e-5
        assert (states[slot].double() - ref_state).abs().max() < 1e-5
    for untouched in (0, 2, 5):
        assert torch.equal(states[untouched], before[untouched])


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_a_delta_net_decode_step_in_one_call_equals_the_torch_ops(monkeypatch, tiled):
    """The compiled layer step (conv, norms, gates, the rule, the gated norm) equals the
    same layer's torch ops on random weights and states, the states left alike, with
    the value heads in either order (more value heads than key heads)."""
    from tandem.models.config import ModelConfig
    from tandem.models.gated_delta_net import GatedDeltaNet
    from tandem.runner.state_cache import RecurrentBatch, StateCache

    if cpu_kernels.load() is None:
        pytest.skip("no compiled CPU kernels here")
    options = dict(key_heads=2, value_heads=4, key_dim=16, value_dim=8, conv_width=4,
                   tiled_value_heads=tiled)  # fmt: skip
    config = ModelConfig(
        "Qwen3_5ForCausalLM", 64, 48, 1, 2, 1, 16, 64, 64, 1e-6, "silu", False, None,
        recurrent_layers=(0,), recurrent_state=delta_net_shapes(options),
        family_options=options,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = GatedDeltaNet(config, 0)
    for param in layer.parameters():
        param.data = torch.randn_like(param) * 0.3
    layer.A.data = -layer.A.data.abs()
    x = torch.randn(3, 48)
    outs, caches = [], []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(cpu_kernels, "available", lambda device, dtype: False)
        cache = StateCache(config, 5, torch.device("cpu"))
        gen = torch.Generator().manual_seed(1)
        for tensor in cache.layers[0]:
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
        attn = type("Attn", (), {})()
        attn.recurrent = RecurrentBatch.build(cache, [1, 1, 1], [5, 9, 2], [4, 0, 2], "cpu")
        with torch.no_grad():
            outs.append(layer(x, attn))
        caches.append(cache.layers[0])
    assert (outs[0] - outs[1]).abs().max() < 1e-5
    for compiled, plain in zip(*caches, strict=True):
        assert (compiled - plain).abs().max() < 1e-5


@pytest.mark.unit
def test_the_budget_holds_the_slots_and_the_blocks():
    """Slots for max_num_seqs when they fit half the budget, else what half holds, at
    least one; the KV blocks get the rest."""
    raw = transformers.Qwen3_5TextConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16,
    ).to_dict()  # fmt: skip
    raw["architectures"] = ["Qwen3_5ForCausalLM"]
    config = parse_qwen3_5_config(raw)
    per = config.state_bytes_per_sequence()
    # 3 delta-net layers: conv [2*2*16 + 4*16 = 128, 3] and state [4, 16, 16], float32.
    assert per == 3 * 4 * (128 * 3 + 4 * 16 * 16)
    assert config.kv_layers == (3,) and config.cache_index(3) == 0
    assert split_budget(config, 100 * per, 8) == (8, 92 * per)
    assert split_budget(config, 10 * per, 8) == (5, 5 * per)
    assert split_budget(config, per // 2, 8) == (1, 0)


def test_vision_and_text_folders_load_as_text(tmp_path, model_dirs):
    """The published Qwen3.5 folders (``Qwen3_5ForConditionalGeneration``: the text
    model under model.language_model, a vision tower beside it) load as the text model
    and give transformers' logits for text."""
    _, text_model = model_dirs("qwen3_5")
    text_config = text_model.config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=4, temporal_patch_size=1)  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text_config, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    loaded = load_model(tmp_path)
    from tandem.runner.model_runner import forward_no_cache

    ids = list(range(3, 40))
    ours = forward_no_cache(loaded, torch.tensor([ids]))[0]
    assert_close(ours, reference_logits(text_model, ids))


GGUF_CASES = [("qwen3_5", "f32"), ("qwen3_5", "q8_0"), ("qwen3_5_moe", "f32"),
              ("qwen3_5_moe", "q8_0"), ("qwen3_next", "f32"), ("qwen3_next", "q8_0")]  # fmt: skip
GGUF_NAMES = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}


@pytest.mark.parametrize(("arch", "fmt"), GGUF_CASES)
def test_gguf_files_written_for_llama_cpp_read_back(tmp_path, model_dirs, arch, fmt):
    """A qwen35 (qwen35moe, qwen3next) GGUF file as llama.cpp's converter lays it out
    (norms plus one but the delta net's, ssm_a = -exp(A_log), value heads tiled but in
    qwen3next, its b and a in one interleaved ssm_ba, experts stacked) reads back to
    transformers' logits: exactly from float32, within the quantization's error from
    Q8_0."""
    from tandem.models.gguf_export import export_gguf
    from tandem.models.gguf_file import GGUFFile
    from tandem.runner.model_runner import ModelRunner, SequenceChunk

    # (llama.cpp's qwen3next makes every layer's MLP a mixture)
    folder, hf_model = model_dirs(arch, **({"mlp_only_layers": []} if arch == "qwen3_next" else {}))
    path = export_gguf(folder, tmp_path / f"{arch}-{fmt}.gguf", fmt)
    file = GGUFFile(path)
    names = {t.name for t in file.tensors}
    name = GGUF_NAMES[arch]
    assert file.fields["general.architecture"] == name
    recurrent = [t == "linear_attention" for t in hf_model.config.layer_types]
    assert list(file.fields[f"{name}.attention.recurrent_layers"]) == recurrent
    file.close()
    full = recurrent.index(False)
    assert {"blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.attn_qkv.weight",
            f"blk.{full}.post_attention_norm.weight", f"blk.{full}.attn_q.weight",
            } <= names  # fmt: skip
    if arch == "qwen3_next":
        assert "blk.0.ssm_ba.weight" in names and "blk.0.ssm_beta.weight" not in names
    loaded = load_model(path)
    delta_net = loaded.model.model.layers[0].linear_attn
    assert delta_net.tiled_value_heads == (arch != "qwen3_next")
    ids = list(range(5, 60))
    runner = ModelRunner(loaded, 4, 16, num_state_slots=1)
    ours = runner.forward([SequenceChunk(ids, 0, [0, 1, 2, 3], state_slot=0)], all_logits=True)
    # (Q8_0 moves a mixture's logits more: a token whose top experts trade places under
    # the quantization's error takes another expert's output)
    tolerance = 1e-4 if fmt == "f32" else 3e-2 if arch == "qwen3_5" else 8e-2
    assert_close(ours, reference_logits(hf_model, ids), tolerance)
