from __future__ import annotations

import pytest
import torch

from tandem.server.launch import tandem_process
from tests.hf_models import save_model

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Architecture name -> (folder, transformers model) for one tiny checkpoint each."""
    built = {}

    def get(arch: str, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"{arch}-model")
            built[key] = (folder, save_model(folder, arch, **overrides))
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_server(model_dirs):
    """`tandem serve` on the tiny random Llama, served as "tiny"; yields its base URL."""
    folder, _ = model_dirs("llama")
    with tandem_process("serve", "--model", str(folder), "--served-model-name", "tiny") as url:
        yield url
