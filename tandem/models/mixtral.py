"""Mixtral: the Mistral network whose every MLP is a mixture of experts (models/moe.py).

config.json: ``num_local_experts`` experts of ``intermediate_size``, the top
``num_experts_per_tok`` renormalized to sum to 1. Checkpoint names:
``block_sparse_moe.gate`` (the router) and ``block_sparse_moe.experts.E.w1`` / ``w3``
/ ``w2`` (gate, up, down), mapped to the modules' ``mlp.gate`` and
``mlp.experts.E.gate_up_proj`` (parts 0 and 1) / ``down_proj``.
"""

from __future__ import annotations

from typing import Any

from tandem.models.config import ModelConfig, MoEConfig, require
from tandem.models.family import Family
from tandem.models.llama import LlamaForCausalLM, parse_llama_config

EXPERT_NAMES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def hf_expert_name(name: str) -> str:
    """Mixtral's checkpoint name in Qwen3-MoE's spelling (``mlp.gate``,
    ``mlp.experts.E.gate_proj``...): the one the modules and the GGUF names use."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for theirs, ours in EXPERT_NAMES.items():
        name = name.replace(theirs, ours)
    return name


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        moe = MoEConfig(
            num_experts=require(raw, "num_local_experts", "num_experts"),
            top_k=require(raw, "num_experts_per_tok"),
            intermediate_size=require(raw, "intermediate_size"),
            normalize_top_k=True,
        )
        return parse_llama_config(raw, sliding_window=raw.get("sliding_window"), moe=moe)

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        return super().checkpoint_target(hf_expert_name(name))


# llama.cpp's converter writes Mixtral as llama with experts (``llama.expert_count``).
MIXTRAL = Family(
    "Mixtral",
    ("MixtralForCausalLM",),
    MixtralForCausalLM,
    gguf_architecture="llama",
    gguf_has_experts=True,
    gguf_permuted_qk=True,
    tensor_parallel=True,
    fused_decode=True,
)
