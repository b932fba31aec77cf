"""Qwen3.5 (text): a hybrid of Gated DeltaNet linear attention and gated full attention.

Three of every four layers mix tokens with Gated DeltaNet (models/gated_delta_net.py),
a recurrence with a fixed-size state per sequence (the state cache); the fourth attends
over the paged K/V cache. What differs from Qwen3, each as transformers'
``Qwen3_5ForCausalLM`` computes it:

- ``layer_types`` names each layer ``linear_attention`` or ``full_attention``; only the
  attention layers keep K/V (ModelConfig.recurrent_layers, ``cache_index``).
- The attention's q projection has twice the width: per head, the query then a gate;
  the output is multiplied by sigmoid(gate) before o_proj. q and k are RMS-normed per
  head; the rotary turns only the first quarter of each head (partial_rotary_factor).
- Every RMSNorm but the delta net's scales by 1 + weight (Gemma's).

Checkpoints: ``Qwen3_5ForCausalLM`` folders name the layers ``model.layers.N``; the
published ``Qwen3_5ForConditionalGeneration`` ones (text and vision) hold the text model
under ``model.language_model`` and its config under ``text_config``: read as the text
model, the vision tower left out (images are the vision issue's).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig, require
from tandem.models.family import Family
from tandem.models.gated_delta_net import GatedDeltaNet, delta_net_shapes
from tandem.models.gemma3 import GemmaRMSNorm
from tandem.models.layers import AttentionContext, RotaryEmbedding, RotaryPositions
from tandem.models.linear import Linear, MergedLinear
from tandem.models.llama import GatedMLP, LlamaForCausalLM, LlamaModel, parse_llama_config

LINEAR, FULL = "linear_attention", "full_attention"


def parse_qwen3_5_config(raw: dict[str, Any]) -> ModelConfig:
    text = {**raw, **(raw.get("text_config") or {})}
    text["architectures"] = raw.get("architectures")
    num_layers = require(text, "num_hidden_layers")
    interval = text.get("full_attention_interval") or 4
    layer_types = text.get("layer_types") or [
        FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)
    ]
    if set(layer_types) - {LINEAR, FULL} or len(layer_types) != num_layers:
        raise ModelLoadError(f"Qwen3.5 layer_types must name {num_layers} of {LINEAR}, {FULL}")
    options = {
        "key_heads": require(text, "linear_num_key_heads"),
        "value_heads": require(text, "linear_num_value_heads"),
        "key_dim": require(text, "linear_key_head_dim"),
        "value_dim": require(text, "linear_value_head_dim"),
        "conv_width": text.get("linear_conv_kernel_dim") or 4,
    }
    if options["value_heads"] % options["key_heads"]:
        raise ModelLoadError("Qwen3.5: linear_num_value_heads must be a multiple of key heads")
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope.setdefault("partial_rotary_factor", text.get("partial_rotary_factor") or 0.25)
    rope.setdefault("rope_theta", text.get("rope_theta") or 10_000.0)
    for key in ("mrope_section", "mrope_interleaved"):  # (text positions: all axes alike)
        rope.pop(key, None)
    text["rope_parameters"] = rope
    text["head_dim"] = text.get("head_dim") or 256
    return parse_llama_config(
        text,
        max_position_embeddings=text.get("max_position_embeddings") or 32768,
        qk_norm=True,
        recurrent_layers=tuple(i for i, kind in enumerate(layer_types) if kind == LINEAR),
        recurrent_state=delta_net_shapes(options),
        family_options=options,
    )


class GatedAttention(nn.Module):
    """Attention whose output each head gates by sigmoid of a second query-sized
    projection (q and its gate interleaved per head in q_proj's rows)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.cache_index = config.cache_index(layer_idx)
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = [2 * q_size, kv_size, kv_size]
        self.qkv_proj = MergedLinear(config.hidden_size, self.split_sizes, bias=False)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.norm_eps)
        self.scale = config.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, rope: RotaryPositions, attn
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q_gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        q = self.q_norm(q)
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary.rotate(q, k, rope)
        out = attn.attend(self.cache_index, q, k, v, self.scale)
        out = out.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(out)


class Qwen3_5DecoderLayer(nn.Module):
    rotary_index = 0

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        if layer_idx in config.recurrent_layers:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = GatedAttention(config, layer_idx)
        self.mlp = GatedMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, h, residual, rotary, rope, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block over the residual stream (LlamaDecoderLayer's contract)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, attn)
        else:
            h = self.self_attn(h, rotary, rope, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Checkpoint names are Hugging Face's, q/k/v and gate/up fused as Llama's, and the
    delta net's four input projections fused into ``in_proj``."""

    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        **LlamaForCausalLM.packed_modules,
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_qwen3_5_config(raw)

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = LlamaModel(config, Qwen3_5DecoderLayer)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        m = self.model
        h = self.embed(input_ids)
        rotary = m.rotaries[0]
        rope = rotary.prepare(positions, h.dtype)
        residual = None
        for layer in m.layers:
            h, residual = layer(h, residual, rotary, rope, attn)
        return m.norm(h, residual)[0]

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        if name.startswith(("model.visual.", "mtp.")):
            return None  # the vision tower; multi-token prediction layers
        return super().checkpoint_target(name.replace("model.language_model.", "model.", 1))


QWEN3_5 = Family(
    "Qwen3.5",
    ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    Qwen3_5ForCausalLM,
)
