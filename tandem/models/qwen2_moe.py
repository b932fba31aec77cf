"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 whose MLPs are mixtures of experts
with a shared expert (models/moe.py).

config.json: as Qwen3-MoE's (models/qwen3_moe.py: ``num_experts`` of
``moe_intermediate_size``, ``num_experts_per_tok`` picked, renormalized only when
``norm_topk_prob``, dense layers by ``mlp_only_layers`` and ``decoder_sparse_step``),
plus ``shared_expert_intermediate_size``: the shared expert every token runs, scaled
by sigmoid of ``mlp.shared_expert_gate`` (a 1-output linear layer); biases on q/k/v
as ``qkv_bias`` says (Qwen2's). Checkpoint names are Hugging Face's
(``mlp.shared_expert.gate_proj``...), as the modules are named.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.models.config import ModelConfig
from tandem.models.family import Family
from tandem.models.qwen2 import Qwen2ForCausalLM
from tandem.models.qwen3_moe import parse_qwen3_moe


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        moe = dataclasses.replace(
            parse_qwen3_moe(raw),
            shared_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
        )
        config = Qwen2ForCausalLM.parse_config(raw)
        return dataclasses.replace(config, attention_bias=bool(raw.get("qkv_bias", True)), moe=moe)


QWEN2_MOE = Family(
    "Qwen 2 MoE",
    ("Qwen2MoeForCausalLM",),
    Qwen2MoeForCausalLM,
    gguf_architecture="qwen2moe",
    gguf_has_experts=True,
    gguf_renormalizes_experts=False,
    gguf_shared_expert=True,
    tensor_parallel=True,
    fused_decode=True,
)
