"""GPT-2: learned positions, LayerNorm, fused c_attn, gelu_new MLP, tied lm_head.

Checkpoints store c_attn/c_proj/c_fc as Conv1D ([in, out]); they are transposed to the
nn.Linear layout once, at load time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.models.config import ModelConfig, architecture_of, checkpoint_dtype, eos_ids, require
from tandem.models.family import Family
from tandem.models.layers import AttentionContext, activation
from tandem.models.linear import Linear

CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, scale: float) -> None:
        super().__init__()
        e = config.hidden_size
        width = config.num_heads * config.head_dim  # e, unless a tensor-parallel shard
        self.ln_1 = nn.LayerNorm(e, eps=config.norm_eps)
        self.attn = nn.Module()
        self.attn.c_attn = Linear(e, 3 * width)
        self.attn.c_proj = Linear(width, e)
        self.ln_2 = nn.LayerNorm(e, eps=config.norm_eps)
        self.mlp = nn.Module()
        self.mlp.c_fc = Linear(e, config.intermediate_size)
        self.mlp.c_proj = Linear(config.intermediate_size, e)
        self.act = activation(config.hidden_act)
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = scale

    def forward(self, h: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        num_tokens = h.shape[0]
        q, k, v = self.attn.c_attn(self.ln_1(h)).chunk(3, dim=-1)
        shape = (num_tokens, self.num_heads, self.head_dim)
        out = attn.attend(self.layer_idx, q.view(shape), k.view(shape), v.view(shape), self.scale)
        h = h + self.attn.c_proj(out.reshape(num_tokens, -1))
        return h + self.mlp.c_proj(self.act(self.mlp.c_fc(self.ln_2(h))))


class GPT2LMHeadModel(nn.Module):
    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        hidden = require(raw, "n_embd", "hidden_size")
        num_heads = require(raw, "n_head", "num_attention_heads")
        return ModelConfig(
            architecture=architecture_of(raw),
            vocab_size=require(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=require(raw, "n_layer", "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=hidden // num_heads,
            intermediate_size=raw.get("n_inner") or 4 * hidden,
            max_position_embeddings=require(raw, "n_positions", "max_position_embeddings"),
            norm_eps=raw.get("layer_norm_epsilon") or 1e-5,
            hidden_act=raw.get("activation_function") or "gelu_new",
            tie_word_embeddings=raw.get("tie_word_embeddings", True),
            rope=None,
            checkpoint_dtype=checkpoint_dtype(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids(raw.get("eos_token_id")),
            family_options={
                "scale_attn_weights": raw.get("scale_attn_weights", True),
                "scale_attn_by_inverse_layer_idx": raw.get(
                    "scale_attn_by_inverse_layer_idx", False
                ),
            },
        )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        options = config.family_options
        self.config = config
        e = config.hidden_size
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(config.vocab_size, e)
        self.transformer.wpe = nn.Embedding(config.max_position_embeddings, e)
        blocks = []
        for i in range(config.num_layers):
            scale = config.head_dim**-0.5 if options["scale_attn_weights"] else 1.0
            if options["scale_attn_by_inverse_layer_idx"]:
                scale /= i + 1
            blocks.append(GPT2Block(config, i, scale))
        self.transformer.h = nn.ModuleList(blocks)
        self.transformer.ln_f = nn.LayerNorm(e, eps=config.norm_eps)
        self.lm_head = Linear(e, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        t = self.transformer
        h = t.wte(input_ids) + t.wpe(positions)
        for block in t.h:
            h = block(h, attn)
        return t.ln_f(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None  # causal-mask buffers of old checkpoints
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else (name, None)
        # Hub GPT-2 checkpoints omit the "transformer." prefix; newer saves include it.
        if not name.startswith("transformer."):
            name = "transformer." + name
        return name, None

    def stores_transposed(self, name: str) -> bool:
        """The file holds this matrix as [in, out] (Conv1D)."""
        return name.endswith(CONV1D_WEIGHTS)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if self.stores_transposed(name) else tensor


# No GGUF reading (llama.cpp's gpt2 files are rare) and no fused decode hook: GPT-2's
# blocks (LayerNorm, learned positions) run layer by layer.
GPT2 = Family("GPT-2", ("GPT2LMHeadModel",), GPT2LMHeadModel, tensor_parallel=True)
