"""Every model family tandem runs (one Family descriptor each, models/family.py), the
lookups by config.json architecture and by GGUF architecture, and the shape every
model class has (``CausalLM``): what the loader, the runner and the saver call.

A new family: its module (the model class and its Family) and one entry in FAMILIES."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tandem.errors import ModelLoadError
from tandem.models.bert import BERT, XLM_ROBERTA
from tandem.models.config import ModelConfig
from tandem.models.decoder_classifier import causal_names
from tandem.models.family import Family
from tandem.models.gemma3 import GEMMA3
from tandem.models.gemma4 import GEMMA4
from tandem.models.gpt2 import GPT2
from tandem.models.gpt_oss import GPT_OSS
from tandem.models.granite_hybrid import GRANITE_HYBRID
from tandem.models.layers import AttentionContext
from tandem.models.lfm2 import LFM2, LFM2_MOE
from tandem.models.llama import LLAMA, MISTRAL
from tandem.models.mixtral import MIXTRAL
from tandem.models.modernbert import MODERNBERT
from tandem.models.qwen2 import QWEN2
from tandem.models.qwen2_moe import QWEN2_MOE
from tandem.models.qwen3 import QWEN3
from tandem.models.qwen3_5 import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from tandem.models.qwen3_moe import QWEN3_MOE


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

    # Optionally (a staticmethod): ``checkpoint_tensors(tensors, config) -> tensors``,
    # the checkpoint's tensors as the family's names take them (gpt-oss: each stacked
    # expert tensor as every expert's own; Qwen3-Next: its per-head interleaved
    # projection apart); the loader and the GGUF writer apply it.


FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    QWEN2_MOE,
    QWEN3_MOE,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_NEXT,
    LFM2,
    LFM2_MOE,
    GRANITE_HYBRID,
    MIXTRAL,
    GEMMA3,
    GEMMA4,
    GPT_OSS,
    GPT2,
    BERT,
    XLM_ROBERTA,
    MODERNBERT,
)
_BY_ARCHITECTURE = {name: family for family in FAMILIES for name in family.architectures}


def family_of(architecture: str) -> Family:
    """The family of a config.json architecture name (a ModelConfig's ``architecture``)."""
    family = next(
        (_BY_ARCHITECTURE[n] for n in causal_names(architecture) if n in _BY_ARCHITECTURE), None
    )
    if family is None:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(_BY_ARCHITECTURE)}"
        )
    return family


def family_for(raw_config: dict[str, Any]) -> Family:
    """The family of a config.json (the first of its ``architectures`` tandem runs)."""
    names = raw_config.get("architectures") or []
    for name in names:
        for known in causal_names(name):
            if known in _BY_ARCHITECTURE:
                return _BY_ARCHITECTURE[known]
    shown = ", ".join(names) if names else "none given in config.json"
    raise ModelLoadError(
        f"unsupported architecture ({shown}); supported: {', '.join(_BY_ARCHITECTURE)}"
    )


def model_class_for(raw_config: dict[str, Any]) -> type[CausalLM]:
    return family_for(raw_config).model_class


GGUF_ARCHITECTURES = sorted({f.gguf_architecture for f in FAMILIES if f.gguf_architecture})


def gguf_family(architecture: str, has_experts: bool) -> Family | None:
    """The family a GGUF file's ``general.architecture`` names (llama with experts is
    Mixtral); None when tandem reads no such file."""
    named = [f for f in FAMILIES if f.gguf_architecture == architecture]
    if len(named) > 1:
        named = [f for f in named if f.gguf_has_experts == has_experts] or named
    return named[0] if named else None
