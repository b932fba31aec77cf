"""Qwen3-MoE: Qwen3 whose MLPs are mixtures of experts (models/moe.py).

config.json: ``num_experts`` (transformers 5 writes ``num_local_experts``) experts of
``moe_intermediate_size``, ``num_experts_per_tok`` picked, renormalized when
``norm_topk_prob``; layer i is sparse unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step`` is not 0 (then a dense MLP of
``intermediate_size``). Checkpoint names are Hugging Face's (``mlp.gate`` the router,
``mlp.experts.E.gate_proj``...), so the Llama class's mapping serves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.models.config import ModelConfig, MoEConfig, require
from tandem.models.family import Family
from tandem.models.qwen3 import Qwen3ForCausalLM


def parse_qwen3_moe(raw: dict[str, Any]) -> MoEConfig:
    layers = require(raw, "num_hidden_layers")
    step = raw.get("decoder_sparse_step") or 1
    dense = set(raw.get("mlp_only_layers") or ())
    return MoEConfig(
        num_experts=require(raw, "num_experts", "num_local_experts"),
        top_k=require(raw, "num_experts_per_tok"),
        intermediate_size=require(raw, "moe_intermediate_size"),
        normalize_top_k=bool(raw.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(layers) if i in dense or (i + 1) % step),
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return dataclasses.replace(Qwen3ForCausalLM.parse_config(raw), moe=parse_qwen3_moe(raw))


QWEN3_MOE = Family(
    "Qwen 3 MoE",
    ("Qwen3MoeForCausalLM",),
    Qwen3MoeForCausalLM,
    gguf_architecture="qwen3moe",
    gguf_has_experts=True,
    tensor_parallel=True,
    fused_decode=True,
)
