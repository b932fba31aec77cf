"""Bad model folders give one clear error naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.errors import ModelLoadError
from tandem.models.loader import load_model


@pytest.fixture
def broken(tmp_path, model_dirs):
    """A private, writable copy of a good llama folder."""
    folder, _ = model_dirs("llama")
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    return copy


def test_folder_does_not_exist(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist"):
        load_model(tmp_path / "nope")


def test_no_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"has no config.json"):
        load_model(tmp_path)


def test_malformed_config(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"cannot parse .*config.json"):
        load_model(broken)


def test_unsupported_architecture_names_supported_ones(broken):
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"MambaForCausalLM.*supported: LlamaForCausalLM"):
        load_model(broken)


def test_missing_tensor_is_named(broken):
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor.*layers\.1\.mlp\.gate_up_proj"):
        load_model(broken)


def test_misshaped_tensor_names_tensor_and_file(broken):
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(
        ModelLoadError,
        match=r"'model.layers.0.self_attn.k_proj.weight' in model.safetensors has shape \[3, 64\]",
    ):
        load_model(broken)


def test_no_weights(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model.safetensors"):
        load_model(broken)


def test_unreadable_tokenizer(broken):
    (broken / "tokenizer.json").write_text("this is not a tokenizer")
    with pytest.raises(ModelLoadError, match=r"cannot read tokenizer"):
        load_model(broken)


def test_bad_dtype_and_device(broken):
    with pytest.raises(ModelLoadError, match=r"dtype 'int3' is not supported"):
        load_model(broken, dtype="int3")
    with pytest.raises(ModelLoadError, match=r"float16 is not supported on CPU"):
        load_model(broken, dtype="float16")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match=r"no CUDA GPU"):
            load_model(broken, device="cuda")
