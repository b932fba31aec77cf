"""ModernBERT: an encoder (ModelConfig.encoder, as BERT: prompts run whole, nothing is
cached) with rotary positions, pre-norm layers and local attention.

    embeddings   token embedding, then LayerNorm (no positions, no token types)
    layer        pre-norm: x += Wo(attention(LN(x))) (no norm before the first
                 layer's attention); x += Wo(act(input) * gate), [input, gate] = Wi(LN(x))
    attention    q/k/v fused (Wqkv), rotary on q and k; every ``global_attn_every_n``-th
                 layer (layer_types' full_attention) attends the whole prompt with
                 base ``global_rope_theta``, the others a token's neighbours within
                 local_attention / 2 on either side with base ``local_rope_theta``
                 (ModelConfig.sliding_window holds that half window for an encoder)
    head         ...ForSequenceClassification: classifier(LN(act(dense(pooled))))
                 over the first token's row, or the prompt's mean (classifier_pooling)

LayerNorms and linear layers have no bias unless norm_bias / attention_bias /
mlp_bias say so. A checkpoint names the encoder with or without ``model.``; a
masked-LM head is not read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.models.bert import Encoder
from tandem.models.config import ModelConfig, architecture_of, checkpoint_dtype, parse_rope, require
from tandem.models.family import Family
from tandem.models.layers import AttentionContext, RotaryEmbedding, activation
from tandem.models.linear import Linear

FULL, SLIDING = "full_attention", "sliding_attention"
UNUSED = ("decoder.", "head.", "embeddings.position_ids")  # (head.: a masked-LM's)


def parse_modernbert_config(raw: dict[str, Any]) -> ModelConfig:
    hidden = require(raw, "hidden_size")
    num_heads = require(raw, "num_attention_heads")
    num_layers = require(raw, "num_hidden_layers")
    head_dim = hidden // num_heads
    every = raw.get("global_attn_every_n_layers") or 3
    layer_types = raw.get("layer_types") or [
        SLIDING if i % every else FULL for i in range(num_layers)
    ]
    rope_parameters = raw.get("rope_parameters") or {}
    thetas = {
        FULL: (rope_parameters.get(FULL) or {}).get("rope_theta")
        or raw.get("global_rope_theta") or 160000.0,
        SLIDING: (rope_parameters.get(SLIDING) or {}).get("rope_theta")
        or raw.get("local_rope_theta") or 10000.0,
    }  # fmt: skip
    ropes = {kind: parse_rope({"rope_theta": theta}, head_dim) for kind, theta in thetas.items()}
    num_labels = len(raw["id2label"]) if raw.get("id2label") else raw.get("num_labels", 0)
    classifies = architecture_of(raw).endswith("ForSequenceClassification")
    return ModelConfig(
        architecture=architecture_of(raw),
        vocab_size=require(raw, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        intermediate_size=require(raw, "intermediate_size"),
        max_position_embeddings=raw.get("max_position_embeddings") or 8192,
        norm_eps=raw.get("norm_eps") or 1e-5,
        hidden_act=raw.get("hidden_activation") or "gelu",
        tie_word_embeddings=False,
        rope=ropes[FULL],
        attention_bias=bool(raw.get("attention_bias")),
        attention_out_bias=bool(raw.get("attention_bias")),
        mlp_bias=bool(raw.get("mlp_bias")),
        sliding_window=(raw.get("local_attention") or 128) // 2,
        sliding_layers=tuple(i for i, kind in enumerate(layer_types) if kind == SLIDING),
        checkpoint_dtype=checkpoint_dtype(raw),
        encoder=True,
        family_options={
            "local_rope": ropes[SLIDING],
            "norm_bias": bool(raw.get("norm_bias")),
            "num_labels": num_labels if classifies else 0,
            "classifier_pooling": raw.get("classifier_pooling") or "cls",
            "classifier_bias": bool(raw.get("classifier_bias")),
            "classifier_activation": raw.get("classifier_activation") or "gelu",
        },
    )


def _norm(config: ModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(
        config.hidden_size, eps=config.norm_eps, bias=config.family_options["norm_bias"]
    )


class ModernBertLayer(nn.Module):
    """Named as transformers' ModernBertEncoderLayer."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        e = config.hidden_size
        self.attn_norm = nn.Identity() if layer_idx == 0 else _norm(config)
        self.attn = nn.Module()
        self.attn.Wqkv = Linear(e, 3 * e, bias=config.attention_bias)
        self.attn.Wo = Linear(e, e, bias=config.attention_out_bias)
        self.mlp_norm = _norm(config)
        self.mlp = nn.Module()
        self.mlp.Wi = Linear(e, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.mlp.Wo = Linear(config.intermediate_size, e, bias=config.mlp_bias)
        self.act = activation(config.hidden_act)
        self.layer_idx = layer_idx
        self.rotary_index = 1 if config.layer_windows()[layer_idx] is not None else 0
        self.heads = (config.num_heads, config.head_dim)
        self.scale = config.head_dim**-0.5

    def forward(self, h, rotary: RotaryEmbedding, rope, attn: AttentionContext) -> torch.Tensor:
        shape = (h.shape[0], *self.heads)
        q, k, v = (t.reshape(shape) for t in self.attn.Wqkv(self.attn_norm(h)).chunk(3, dim=-1))
        q, k = rotary.rotate(q.contiguous(), k.contiguous(), rope)
        out = attn.attend(self.layer_idx, q, k, v, self.scale)
        h = h + self.attn.Wo(out.reshape(h.shape[0], -1))
        up, gate = self.mlp.Wi(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.mlp.Wo(self.act(up) * gate)


class ModernBertModel(Encoder):
    """ModernBertModel and ModernBertForSequenceClassification: ``forward`` gives the
    final hidden states; ``classify`` a head's scores of pooled rows."""

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_modernbert_config(raw)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        options = config.family_options
        self.config = config
        e = config.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = nn.Embedding(config.vocab_size, e)
        self.embeddings.norm = _norm(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_layers))
        self.final_norm = _norm(config)
        assert config.rope is not None
        self.rotaries = nn.ModuleList(  # global layers' rotary, then local layers'
            RotaryEmbedding(rope, config.max_position_embeddings)
            for rope in (config.rope, options["local_rope"])
        )
        self.num_labels = options["num_labels"]
        # Which rows the head reads (runner/pooling.py): BERT's first token, or the mean.
        self.classify_reads = "mean" if options["classifier_pooling"] == "mean" else "first"
        if self.num_labels:
            self.head = nn.Module()
            self.head.dense = Linear(e, e, bias=options["classifier_bias"])
            self.head.norm = _norm(config)
            self.head_act = activation(options["classifier_activation"])
            self.classifier = Linear(e, self.num_labels)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        h = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        ropes = [(rotary, rotary.prepare(positions, h.dtype)) for rotary in self.rotaries]
        for layer in self.layers:
            h = layer(h, *ropes[layer.rotary_index], attn)
        return self.final_norm(h)

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """Pooled final hidden states [N, hidden] -> the head's logits [N, labels]."""
        if not self.num_labels:
            raise ValueError("this model has no classification head (it embeds; it does not score)")
        pooled = self.head.norm(self.head_act(self.head.dense(rows)))
        return self.classifier(pooled).float()

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        name = name.removeprefix("model.")
        if name.startswith(UNUSED) and not (self.num_labels and name.startswith("head.")):
            return None
        return name, None


MODERNBERT = Family(
    "ModernBERT",
    ("ModernBertModel", "ModernBertForSequenceClassification"),
    ModernBertModel,
)
