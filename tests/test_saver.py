"""Saving a tandem model as a Hugging Face folder: transformers and tandem read it back."""

from __future__ import annotations

import torch
import transformers

from tandem.models.loader import load_model
from tandem.models.random_weights import random_model
from tandem.models.saver import save_pretrained
from tandem.runner.model_runner import forward_no_cache

RAW_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def test_saved_folder_round_trips_through_transformers(tmp_path):
    original = random_model(RAW_CONFIG, dtype="float32", seed=3)
    with torch.no_grad():  # non-trivial norms, so a swapped tensor would show
        for name, param in original.model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    folder = save_pretrained(
        original.model, RAW_CONFIG, tmp_path / "saved", generation_config={"eos_token_id": 1}
    )
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    expected = forward_no_cache(original, ids)
    reloaded = load_model(folder, load_tokenizer=False)
    torch.testing.assert_close(forward_no_cache(reloaded, ids), expected)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits.float(), expected, atol=1e-4, rtol=1e-4)
