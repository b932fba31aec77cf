"""Architecture name (config.json ``architectures``) -> model class, and the shape
every model class has (``CausalLM``): what the loader, the runner and the saver call."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig
from tandem.models.gemma3 import Gemma3ForCausalLM
from tandem.models.gpt2 import GPT2LMHeadModel
from tandem.models.layers import AttentionContext
from tandem.models.llama import LlamaForCausalLM
from tandem.models.mixtral import MixtralForCausalLM
from tandem.models.qwen2 import Qwen2ForCausalLM
from tandem.models.qwen2_moe import Qwen2MoeForCausalLM
from tandem.models.qwen3 import Qwen3ForCausalLM
from tandem.models.qwen3_moe import Qwen3MoeForCausalLM


class CausalLM(Protocol):
    """A model family's class: built from its ModelConfig on the meta device, filled
    from checkpoint tensors, run on a flat token batch."""

    config: ModelConfig

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        """The family's config.json -> the family-neutral ModelConfig."""
        ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        """Token ids [T] at ``positions`` [T] -> final hidden states [T, hidden]; every
        attention layer goes through ``attn`` (paged cache or none)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] -> float32 logits [N, vocab]."""
        ...

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        """Where checkpoint tensor ``name`` goes: (parameter, part of a fused one) or
        None to skip it."""
        ...

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor in this class's layout (e.g. GPT-2's Conv1D weights transposed)."""
        ...

    def tie_weights(self) -> None:
        """Share the LM head with the embedding when the config says so."""
        ...


MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class_for(raw_config: dict[str, Any]) -> type[CausalLM]:
    names = raw_config.get("architectures") or []
    for name in names:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    shown = ", ".join(names) if names else "none given in config.json"
    raise ModelLoadError(
        f"unsupported architecture ({shown}); supported: {', '.join(MODEL_CLASSES)}"
    )
