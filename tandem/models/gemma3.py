"""Gemma 3 (text): the Llama network with local and global attention layers.

What differs from Llama, each as transformers' ``Gemma3ForCausalLM`` computes it:

- Five of every six layers attend a sliding window (``layer_types``; 512 tokens in
  the 270M model) with rotary base 10,000; the others attend everything with base
  1,000,000 (and the rope scaling, if any). Each kind has its own rotary table.
- Per-head RMSNorm of q and k, and four norms per block: before and after attention,
  before and after the MLP. Each sublayer's output is normed before it joins the
  residual stream.
- Gemma's RMSNorm scales by ``1 + weight``, in float32 before rounding to the model
  dtype (``GemmaRMSNorm``); in float32 the shared RMSNorm kernel computes the same.
- GeGLU: the gated MLP with tanh-approximated GELU.
- Embeddings are multiplied by sqrt(hidden) (rounded to the model dtype first), the
  LM head is the unscaled embedding; attention scores are scaled by
  ``query_pre_attn_scalar ** -0.5``; logits are soft-capped when the config says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig, parse_rope, require
from tandem.models.family import Family
from tandem.models.layers import RMSNorm, RotaryEmbedding
from tandem.models.linear import Linear
from tandem.models.llama import (
    GatedMLP,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    parse_llama_config,
)

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def _rope_parameters(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rotary settings per layer kind, from transformers 5's ``rope_parameters`` keyed
    by kind or the older ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``."""
    params = raw.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        by_kind = {kind: dict(params.get(kind) or {}) for kind in (FULL, SLIDING)}
    else:
        full = {**(raw.get("rope_scaling") or {}), **params}
        if raw.get("rope_theta") is not None:
            full.setdefault("rope_theta", raw["rope_theta"])
        local = {}
        if raw.get("rope_local_base_freq") is not None:
            local["rope_theta"] = raw["rope_local_base_freq"]
        by_kind = {FULL: full, SLIDING: local}
    for kind, theta in DEFAULT_THETA.items():
        by_kind[kind].setdefault("rope_theta", theta)
    return by_kind


def parse_gemma3_config(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with bidirectional attention (an encoder) is not supported")
    if raw.get("attn_logit_softcapping"):
        raise ModelLoadError("Gemma 3 with attn_logit_softcapping is not supported")
    num_layers = require(raw, "num_hidden_layers")
    pattern = raw.get("sliding_window_pattern") or 6
    layer_types = raw.get("layer_types") or [
        SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)
    ]
    unknown = set(layer_types) - {SLIDING, FULL}
    if unknown or len(layer_types) != num_layers:
        raise ModelLoadError(f"Gemma 3 layer_types must name {num_layers} of {SLIDING}, {FULL}")
    head_dim = raw.get("head_dim") or 256
    ropes = {
        kind: parse_rope({"rope_parameters": params}, head_dim)
        for kind, params in _rope_parameters(raw).items()
    }
    return parse_llama_config(
        {**raw, "rope_parameters": None, "rope_scaling": None},
        head_dim=head_dim,
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        max_position_embeddings=raw.get("max_position_embeddings") or 131072,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qk_norm=True,
        rope=ropes[FULL],
        sliding_window=raw.get("sliding_window") or 4096,
        sliding_layers=tuple(i for i, kind in enumerate(layer_types) if kind == SLIDING),
        family_options={
            "local_rope": ropes[SLIDING],
            "query_pre_attn_scalar": raw.get("query_pre_attn_scalar") or head_dim,
            "final_logit_softcapping": raw.get("final_logit_softcapping"),
        },
    )


class GemmaRMSNorm(RMSNorm):
    """``(x / rms(x) * (1 + weight)).to(dtype)`` with the norm and the scale in float32;
    ``weight`` is the checkpoint's. In float32 that is the shared RMSNorm's arithmetic
    (its kernel included) with ``1 + weight`` as the multiplier. (Gemma 4's norms:
    ``offset`` 0, the weight itself.)"""

    offset = 1.0
    _multiplier: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def multiplier(self) -> torch.Tensor:
        # Computed once per weight version (the kernel path runs without autograd).
        key = (self.weight.data_ptr(), self.weight._version)
        if self._multiplier is None or self._multiplier[0] != key:
            self._multiplier = (key, self.offset + self.weight.detach().float())
        return self._multiplier[1]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.offset + self.weight.float())).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scale = config.family_options["query_pre_attn_scalar"] ** -0.5
        self.q_norm = GemmaRMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.norm_eps)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Llama's block (its forward, the fused decode hook included) with a norm after
    attention and around the MLP; local layers use the second rotary table."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = GatedMLP(config)
        self.rotary_index = 1 if config.layer_windows()[layer_idx] is not None else 0
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.norm_eps)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def norms(self) -> tuple[RMSNorm | None, ...]:
        attn = self.self_attn
        return (
            self.input_layernorm, self.pre_feedforward_layernorm, attn.q_norm, attn.k_norm,
            self.post_attention_layernorm, self.post_feedforward_layernorm,
        )  # fmt: skip

    def attention_and_mlp(self, h, residual, rotary, rope, attn):
        h = self.post_attention_layernorm(self.self_attn(h, rotary, rope, attn))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)
        assert config.rope is not None
        self.rotaries = nn.ModuleList(  # global layers' rotary, then local layers'
            RotaryEmbedding(rope, config.max_position_embeddings)
            for rope in (config.rope, config.family_options["local_rope"])
        )


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Checkpoint names and values are Hugging Face's (q/k/v and gate/up fused as
    Llama's)."""

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_gemma3_config(raw)

    model_class: type[nn.Module] = Gemma3Model  # (Gemma 4's its own)

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = type(self).model_class(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.softcap = config.family_options["final_logit_softcapping"]
        self._embed_scales: dict[torch.dtype, float] = {}
        self.tie_weights()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        return h * self.embed_scale(h.dtype)

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden) rounded to float32 (the reference's buffer), then to ``dtype``:
        exact in ``dtype``, so multiplying by it as a Python number rounds as the
        reference's tensor product does, without a device tensor per forward."""
        if dtype not in self._embed_scales:
            self._embed_scales[dtype] = rounded_scale(self.config.hidden_size**0.5, dtype)
        return self._embed_scales[dtype]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def rounded_scale(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to float32 and then to ``dtype`` (how a float32 buffer scales a
    tensor of ``dtype`` in the reference), as a Python number."""
    return float(torch.tensor(float(np.float32(value))).to(dtype))


def _read_gguf_keys(reader, config: dict) -> None:
    """Not in a GGUF file: llama.cpp scales scores by 1/sqrt(head_dim), except for the
    27B model (62 layers): 1/sqrt(hidden / heads). Local layers (5 of each 6) use
    rotary base 10,000, the parser's default."""
    is_27b = config["num_hidden_layers"] == 62
    heads_width = config["hidden_size"] // config["num_attention_heads"]
    config["query_pre_attn_scalar"] = heads_width if is_27b else config["head_dim"]


def _write_gguf_keys(writer, config: ModelConfig) -> None:
    """llama.cpp's gemma3 reads the sliding window from the file and fixes the rest:
    5 local layers to 1 global, local rotary base 10,000, scores scaled by
    1/sqrt(head_dim). A model that differs cannot be written faithfully."""
    expected = tuple(None if (i + 1) % 6 == 0 else config.sliding_window
                     for i in range(config.num_layers))  # fmt: skip
    options = config.family_options
    if (
        config.layer_windows() != expected
        or options["local_rope"].theta != 10000.0
        or options["local_rope"].scaling_type != "default"
        or options["query_pre_attn_scalar"] != config.head_dim
        or options["final_logit_softcapping"]
    ):
        raise ModelLoadError(
            "this Gemma 3 config differs from what llama.cpp's gemma3 assumes (5 local "
            "layers to 1 global, local rope base 10000, query_pre_attn_scalar = head_dim, "
            "no logit soft-capping): it cannot be exported faithfully"
        )
    writer.add_sliding_window(config.sliding_window)


GEMMA3 = Family(
    "Gemma 3",
    ("Gemma3ForCausalLM",),
    Gemma3ForCausalLM,
    gguf_architecture="gemma3",
    gguf_norm_plus_one=True,
    # A norm before and after attention and the MLP.
    gguf_layer_names={
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    gguf_read_keys=_read_gguf_keys,
    gguf_write_keys=_write_gguf_keys,
    tensor_parallel=True,
    fused_decode=True,
)
