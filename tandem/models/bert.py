"""BERT and XLM-RoBERTa: encoders. Every token attends to every other token of its
prompt (ModelConfig.encoder), so a prompt runs whole and nothing is cached; the model
makes no tokens, only vectors: embeddings (the final hidden states, pooled as the
sentence-transformers folder says) and, with a classification head, scores
(cross-encoder rerankers: a (query, document) pair in, a relevance score out).

    embeddings   word + position (+ RoBERTa's offset) + token type (a pair's second
                 text is type 1), then LayerNorm
    layer        post-norm: x = LN(x + attention(x)); x = LN(x + MLP(x)); biases
                 everywhere, GELU
    heads        BERT: classifier(tanh(pooler(first token)));
                 RoBERTa: out_proj(tanh(dense(first token)))

Checkpoints name the encoder with or without a ``bert.`` / ``roberta.`` prefix (a
bare model saved by sentence-transformers, or inside a ...ForSequenceClassification);
a masked-LM head, when the file has one, is not read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig, architecture_of, checkpoint_dtype, require
from tandem.models.family import Family
from tandem.models.layers import AttentionContext, activation
from tandem.models.linear import Linear, MergedLinear

# What a file may name the encoder with, and heads tandem does not run (masked LM).
PREFIXES = ("bert.", "roberta.", "model.")
UNUSED = ("cls.predictions.", "cls.seq_relationship.", "lm_head.", "embeddings.position_ids")
QKV_PARTS = {"query": 0, "key": 1, "value": 2}


def parse_encoder_config(raw: dict[str, Any]) -> ModelConfig:
    hidden = require(raw, "hidden_size")
    num_heads = require(raw, "num_attention_heads")
    roberta = raw.get("model_type") in ("roberta", "xlm-roberta") or "Roberta" in (
        architecture_of(raw)
    )
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError("only absolute position embeddings are supported")
    num_labels = len(raw["id2label"]) if raw.get("id2label") else raw.get("num_labels", 0)
    classifies = architecture_of(raw).endswith("ForSequenceClassification")
    # RoBERTa's positions start after its padding id (positions 0..pad are never used).
    offset = raw.get("pad_token_id", 1) + 1 if roberta else 0
    return ModelConfig(
        architecture=architecture_of(raw),
        vocab_size=require(raw, "vocab_size"),
        hidden_size=hidden,
        num_layers=require(raw, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        intermediate_size=require(raw, "intermediate_size"),
        max_position_embeddings=require(raw, "max_position_embeddings") - offset,
        norm_eps=raw.get("layer_norm_eps") or 1e-12,
        hidden_act=raw.get("hidden_act") or "gelu",
        tie_word_embeddings=False,
        rope=None,
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        checkpoint_dtype=checkpoint_dtype(raw),
        encoder=True,
        family_options={
            "position_offset": offset,
            "type_vocab_size": raw.get("type_vocab_size") or 1,
            "num_labels": num_labels if classifies else 0,
            "roberta_head": roberta,
        },
    )


class EncoderLayer(nn.Module):
    """Named as transformers' BertLayer, q/k/v fused into ``attention.self.qkv``."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        e, eps = config.hidden_size, config.norm_eps
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        self.attention.self.qkv = MergedLinear(e, [e, e, e], bias=True)
        self.attention.output = nn.Module()
        self.attention.output.dense = Linear(e, e)
        self.attention.output.LayerNorm = nn.LayerNorm(e, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(e, config.intermediate_size)
        self.output = nn.Module()
        self.output.dense = Linear(config.intermediate_size, e)
        self.output.LayerNorm = nn.LayerNorm(e, eps=eps)
        self.act = activation(config.hidden_act)
        self.layer_idx = layer_idx
        self.heads = (config.num_heads, config.head_dim)
        self.scale = config.head_dim**-0.5

    def forward(self, h: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        shape = (h.shape[0], *self.heads)
        q, k, v = self.attention.self.qkv(h).chunk(3, dim=-1)
        out = attn.attend(self.layer_idx, q.view(shape), k.view(shape), v.view(shape), self.scale)
        a = self.attention.output
        h = a.LayerNorm(h + a.dense(out.reshape(h.shape[0], -1)))
        up = self.act(self.intermediate.dense(h))
        return self.output.LayerNorm(h + self.output.dense(up))


class Encoder(nn.Module):
    """What every encoder class shares (BERT's, ModernBERT's): no tokens, no LM head
    to tie, checkpoint tensors taken as they are."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("an encoder makes no tokens")

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def tie_weights(self) -> None:
        pass


class EncoderModel(Encoder):
    """BertModel, XLMRobertaModel and their ...ForSequenceClassification: ``forward``
    gives the final hidden states; ``classify`` a head's scores of first-token rows."""

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_encoder_config(raw)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        options = config.family_options
        self.config = config
        e = config.hidden_size
        self.position_offset = options["position_offset"]
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(config.vocab_size, e)
        positions = config.max_position_embeddings + self.position_offset
        self.embeddings.position_embeddings = nn.Embedding(positions, e)
        self.embeddings.token_type_embeddings = nn.Embedding(options["type_vocab_size"], e)
        self.embeddings.LayerNorm = nn.LayerNorm(e, eps=config.norm_eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            EncoderLayer(config, i) for i in range(config.num_layers)
        )
        self.num_labels = options["num_labels"]
        if self.num_labels and options["roberta_head"]:
            self.classifier = nn.Module()
            self.classifier.dense = Linear(e, e)
            self.classifier.out_proj = Linear(e, self.num_labels)
        elif self.num_labels:
            self.pooler = nn.Module()
            self.pooler.dense = Linear(e, e)
            self.classifier = Linear(e, self.num_labels)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        emb = self.embeddings
        types = getattr(attn, "token_types", None)
        h = emb.word_embeddings(input_ids) + emb.position_embeddings(
            positions + self.position_offset
        )
        if types is None:
            h = h + emb.token_type_embeddings.weight[0]
        else:
            h = h + emb.token_type_embeddings(types)
        h = emb.LayerNorm(h)
        for layer in self.encoder.layer:
            h = layer(h, attn)
        return h

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """Final hidden states of prompts' first tokens [N, hidden] -> the head's
        logits [N, num_labels], float32."""
        if not self.num_labels:
            raise ValueError("this model has no classification head (it embeds; it does not score)")
        if hasattr(self, "pooler"):
            return self.classifier(torch.tanh(self.pooler.dense(first_rows))).float()
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(first_rows))).float()

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        for prefix in PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name.startswith(UNUSED) or (name.startswith("pooler.") and not hasattr(self, "pooler")):
            return None  # (a bare model's pooler: sentence embeddings never read it)
        for part, index in QKV_PARTS.items():
            if f".attention.self.{part}." in name:
                return name.replace(f".self.{part}.", ".self.qkv."), index
        return name, None


BERT = Family(
    "BERT",
    ("BertModel", "BertForSequenceClassification"),
    EncoderModel,
)
XLM_ROBERTA = Family(
    "XLM-RoBERTa",
    (
        "XLMRobertaModel", "XLMRobertaForSequenceClassification", "RobertaModel",
        "RobertaForSequenceClassification",
    ),
    EncoderModel,
)  # fmt: skip
