"""Qwen2: the Llama network with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig
from tandem.models.family import Family
from tandem.models.llama import LlamaForCausalLM, parse_llama_config


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        if raw.get("use_sliding_window"):
            raise ModelLoadError("Qwen2 with use_sliding_window=true is not supported")
        return parse_llama_config(raw, attention_bias=True, attention_out_bias=False)


QWEN2 = Family(
    "Qwen 2 / 2.5",
    ("Qwen2ForCausalLM",),
    Qwen2ForCausalLM,
    gguf_architecture="qwen2",
    tensor_parallel=True,
    fused_decode=True,
)
