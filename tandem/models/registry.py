"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from typing import Any

from tandem.errors import ModelLoadError
from tandem.models.gpt2 import GPT2LMHeadModel
from tandem.models.llama import LlamaForCausalLM
from tandem.models.qwen2 import Qwen2ForCausalLM
from tandem.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def model_class_for(raw_config: dict[str, Any]) -> type:
    names = raw_config.get("architectures") or []
    for name in names:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    shown = ", ".join(names) if names else "none given in config.json"
    raise ModelLoadError(
        f"unsupported architecture ({shown}); supported: {', '.join(MODEL_CLASSES)}"
    )
