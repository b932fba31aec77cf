"""The Llama decoder: pre-norm blocks, GQA attention with rotary positions, gated MLP.

Mistral is this network with an optional sliding window; Qwen2 and Qwen3 add a flag
(q/k/v bias, per-head q/k RMSNorm) and their files only parse their config. Mixtral
and Qwen3-MoE replace the MLP of their sparse layers with a mixture of experts
(models/moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from tandem.models.config import (
    ModelConfig,
    architecture_of,
    checkpoint_dtype,
    eos_ids,
    parse_rope,
    require,
)
from tandem.models.family import Family
from tandem.models.layers import (
    FUSED_ACTIVATIONS,
    AttentionContext,
    RMSNorm,
    RotaryEmbedding,
    RotaryPositions,
    activation,
    in_row_slices,
)
from tandem.models.linear import Linear, MergedLinear
from tandem.models.moe import SparseMoE


def parse_llama_config(raw: dict[str, Any], **overrides: Any) -> ModelConfig:
    hidden = require(raw, "hidden_size")
    num_heads = require(raw, "num_attention_heads")
    head_dim = raw.get("head_dim") or hidden // num_heads
    fields: dict[str, Any] = dict(
        architecture=architecture_of(raw),
        vocab_size=require(raw, "vocab_size"),
        hidden_size=hidden,
        num_layers=require(raw, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        intermediate_size=require(raw, "intermediate_size"),
        max_position_embeddings=raw.get("max_position_embeddings") or 2048,
        norm_eps=raw.get("rms_norm_eps") or 1e-6,
        hidden_act=raw.get("hidden_act") or "silu",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=parse_rope(raw, head_dim),
        attention_bias=bool(raw.get("attention_bias", False)),
        attention_out_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        checkpoint_dtype=checkpoint_dtype(raw),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw.get("eos_token_id")),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # where its K/V live in the paged cache (a hybrid's recurrent layers keep none)
        self.cache_index = config.cache_index(layer_idx)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias=config.attention_bias
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.qk_norm = config.qk_norm
        self.split_sizes = [q_size, kv_size, kv_size]
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        rope: RotaryPositions,
        attn: AttentionContext,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        # Views into the fused projection's output (no copies): rows are strided.
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary.rotate(q, k, rope)
        out = self.attend(attn, q, k, v)
        return self.o_proj(out.reshape(num_tokens, -1))

    def attend(self, attn: AttentionContext, q, k, v) -> torch.Tensor:
        """The attention itself, through the backend (gpt-oss adds its sinks)."""
        return attn.attend(self.cache_index, q, k, v, self.scale)


# A prompt chunk runs the MLP this many rows at a time on a CPU: its float32 gate/up
# output and their product are a chunk's largest temporaries (2,048 tokens of a 1B
# model: 134 + 67 MB; 8B: 235 + 117 MB), and a slice's are freed before the next. The
# price is reading the MLP's weights once per slice, about 1% of a chunk's time.
MLP_ROWS = 512


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, bias=config.mlp_bias)
        self.act = activation(config.hidden_act)
        self.act_and_mul = FUSED_ACTIVATIONS.get(config.hidden_act)
        self.intermediate_size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and not torch.is_grad_enabled():
            return in_row_slices(self._rows, x, MLP_ROWS)
        return self._rows(x)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    rotary_index = 0  # which of the model's rotary tables this layer's attention uses

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        sparse = config.is_moe_layer(layer_idx)
        self.mlp = SparseMoE(config, GatedMLP) if sparse else GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def norms(self) -> tuple[RMSNorm | None, ...]:
        """The layer's norms in the order the whole-layer decode kernel takes them
        (runner/fused_decode.py): before attention, before the MLP (adding to the
        stream), q and k per head, after attention, after the MLP; None: absent."""
        attn = self.self_attn
        q_norm, k_norm = (attn.q_norm, attn.k_norm) if attn.qk_norm else (None, None)
        return (self.input_layernorm, self.post_attention_layernorm, q_norm, k_norm, None, None)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        rope: RotaryPositions,
        attn: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block over the residual stream: takes the previous block's output
        ``h`` and the stream before it (None for the first block), returns this block's
        output and the stream; each norm adds its input to the stream first. The
        attention backend may run the whole block in one call (``decode_layer``)."""
        fused = getattr(attn, "decode_layer", None)
        if fused is not None:
            out = fused(self, h, residual, rope)
            if out is not None:
                return out
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        return self.attention_and_mlp(h, residual, rotary, rope, attn)

    def attention_and_mlp(self, h, residual, rotary, rope, attn):
        """The block after its input norm: ``h`` normed, ``residual`` the stream."""
        h = self.self_attn(h, rotary, rope, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_class: Callable[[ModelConfig, int], nn.Module] = LlamaDecoderLayer,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        assert config.rope is not None
        rotary = RotaryEmbedding(config.rope, config.max_position_embeddings)
        self.rotaries = nn.ModuleList([rotary])  # one table for every layer


class LlamaForCausalLM(nn.Module):
    """Checkpoint names are Hugging Face's, except that q/k/v and gate/up are stored
    fused (``packed_modules`` says which checkpoint tensor goes to which part)."""

    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Layers the forward passes over (self-speculation drafts with the target minus
    # these: spec_decode/layer_skip.py); empty but while such a draft runs.
    skipped_layers: frozenset[int] = frozenset()
    # What builds layer i: a decoder layer class, or a function of (config, i) that
    # picks one (a hybrid's recurrent and attention layers).
    layer_class: ClassVar[Callable[[ModelConfig, int], nn.Module]] = LlamaDecoderLayer

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_llama_config(raw, sliding_window=raw.get("sliding_window"))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, type(self).layer_class)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        """Flat token batch -> final hidden states [T, hidden]."""
        m = self.model
        h = self.embed(input_ids)
        ropes = [(rotary, rotary.prepare(positions, h.dtype)) for rotary in m.rotaries]
        stack = getattr(attn, "decode_stack", None)  # every layer in one call, if offered
        if stack is not None and not self.skipped_layers:
            out = stack(m.layers, h, [rope for _, rope in ropes])
            if out is not None:
                return m.norm(*out)[0]
        residual = None
        for index, layer in enumerate(m.layers):
            if index in self.skipped_layers:
                continue
            h, residual = layer(h, residual, *ropes[layer.rotary_index], attn)
        return m.norm(h, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        """Where checkpoint tensor ``name`` goes: (parameter name, part) or None to skip."""
        if "rotary_emb.inv_freq" in name:
            return None  # old checkpoints saved this buffer; we recompute it
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for part_name, (fused_name, index) in self.packed_modules.items():
            if f".{part_name}." in name:
                return name.replace(f".{part_name}.", f".{fused_name}."), index
        return name, None

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


LLAMA = Family(
    "Llama 3",
    ("LlamaForCausalLM",),
    LlamaForCausalLM,
    gguf_architecture="llama",
    gguf_permuted_qk=True,
    tensor_parallel=True,
    fused_decode=True,
)
# Mistral 7B: Llama's layers with a sliding window (written to GGUF as llama, without
# the window: llama.cpp's llama has none).
MISTRAL = Family(
    "Mistral",
    ("MistralForCausalLM",),
    LlamaForCausalLM,
    gguf_architecture="mistral",
    gguf_export_as="llama",
    gguf_permuted_qk=True,
    tensor_parallel=True,
    fused_decode=True,
)
