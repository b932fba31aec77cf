"""Qwen3: the Llama network with an RMSNorm on each head of q and k before rotary."""

from __future__ import annotations

from typing import Any

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig
from tandem.models.family import Family
from tandem.models.llama import LlamaForCausalLM, parse_llama_config


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        if raw.get("use_sliding_window"):
            raise ModelLoadError("Qwen3 with use_sliding_window=true is not supported")
        return parse_llama_config(raw, qk_norm=True)


QWEN3 = Family(
    "Qwen 3",
    ("Qwen3ForCausalLM",),
    Qwen3ForCausalLM,
    gguf_architecture="qwen3",
    tensor_parallel=True,
    fused_decode=True,
)
