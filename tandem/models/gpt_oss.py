"""gpt-oss (20b, 120b): the Llama network with every MLP a mixture of experts.

What differs from Llama, each as transformers' ``GptOssForCausalLM`` computes it:

- Attention sinks: a learned logit per query head (``self_attn.sinks``) joins every
  row's softmax as one more key that adds no value, so a head can attend to nothing
  much (the backends take it: models/layers.py's ``AttentionContext.attend``).
- Every second layer attends a 128-token sliding window (``layer_types``: the
  even-numbered layers), the others the whole context; one rotary table, YaRN-scaled
  (factor 32 over 4,096 positions, base 150,000).
- Biases on q/k/v and on the output projection.
- The mixture: a router with a bias; the top k of its logits, softmax over those k
  (the same as softmax over all, renormalized over the k); each expert a gated MLP
  with biases and a clamped SwiGLU: ``(clamp(up, -l, l) + 1) * g * sigmoid(a * g)``
  with ``g = min(gate, l)``, a = 1.702, l = 7.
- Checkpoints hold each layer's experts in one tensor per projection, [experts, in,
  out], gate and up interleaved column by column (``gate_up_proj``); each expert's
  matrices are read from it as tensors of their own (``split_checkpoint_tensor``).

GGUF files (llama.cpp's ``gpt-oss``) hold the experts stacked per projection, gate and
up apart, biases stacked likewise, the sinks as ``attn_sinks.weight``; llama.cpp fixes
what the file does not say: even layers slide, the SwiGLU's 1.702 and 7. YaRN is
computed as transformers computes it for this family (its ramp not truncated to whole
dimensions; llama.cpp's ggml truncates it).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig, MoEConfig, require
from tandem.models.family import Family
from tandem.models.layers import AttentionContext, RMSNorm
from tandem.models.linear import Linear
from tandem.models.llama import (
    GatedMLP,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    parse_llama_config,
)
from tandem.models.moe import SparseMoE
from tandem.models.weight_source import CheckpointTensor

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' GptOssConfig defaults, for a config.json that leaves the rotary out.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEFAULT_THETA = 150_000.0


def parse_gpt_oss_config(raw: dict[str, Any]) -> ModelConfig:
    num_layers = require(raw, "num_hidden_layers")
    layer_types = raw.get("layer_types") or [
        SLIDING if i % 2 == 0 else FULL for i in range(num_layers)
    ]
    if set(layer_types) - {SLIDING, FULL} or len(layer_types) != num_layers:
        raise ModelLoadError(f"gpt-oss layer_types must name {num_layers} of {SLIDING}, {FULL}")
    rotary = dict(raw)
    if not (raw.get("rope_parameters") or raw.get("rope_scaling")):
        rotary["rope_parameters"] = DEFAULT_ROPE
    rotary["rope_theta"] = raw.get("rope_theta") or DEFAULT_THETA
    bias = bool(raw.get("attention_bias", True))
    return parse_llama_config(
        rotary,
        max_position_embeddings=raw.get("max_position_embeddings") or 131072,
        norm_eps=raw.get("rms_norm_eps") or 1e-5,
        attention_bias=bias,
        attention_out_bias=bias,
        sliding_window=raw.get("sliding_window") or 128,
        sliding_layers=tuple(i for i, kind in enumerate(layer_types) if kind == SLIDING),
        moe=MoEConfig(
            num_experts=require(raw, "num_local_experts", "num_experts"),
            top_k=require(raw, "num_experts_per_tok", "experts_per_token"),
            intermediate_size=require(raw, "intermediate_size"),
            normalize_top_k=True,
            router_bias=True,
            expert_bias=True,
        ),
        family_options={
            "swiglu_alpha": float(raw.get("swiglu_alpha") or 1.702),
            "swiglu_limit": float(raw.get("swiglu_limit") or 7.0),
        },
    )


class ClampedSwiGLU(GatedMLP):
    """An expert: gate/up and down with biases, the clamped SwiGLU between. No fused
    activation (``act_and_mul`` None), so the experts' compiled path
    (runner/linear/experts.py) leaves these layers to the loop."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.act_and_mul = None
        self.alpha = config.family_options["swiglu_alpha"]
        self.limit = config.family_options["swiglu_limit"]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.sinks = nn.Parameter(torch.empty(config.num_heads))

    def attend(self, attn: AttentionContext, q, k, v) -> torch.Tensor:
        return attn.attend(self.layer_idx, q, k, v, self.scale, sinks=self.sinks)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(config, layer_idx)
        self.mlp = SparseMoE(config, ClampedSwiGLU)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)


_SINKS = ".self_attn.sinks"
# A layer's experts in one tensor per projection (Hugging Face's names).
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


class GptOssForCausalLM(LlamaForCausalLM):
    """Checkpoint names are Hugging Face's, the router read as the mixture's ``gate``
    and each layer's stacked experts split into experts (``split_checkpoint_tensor``)."""

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_gpt_oss_config(raw)

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = LlamaModel(config, GptOssDecoderLayer)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        return super().checkpoint_target(name.removesuffix(".weight") if _SINKS in name else name)

    @staticmethod
    def split_checkpoint_tensor(tensor: CheckpointTensor) -> list[CheckpointTensor]:
        """A Hugging Face checkpoint's tensor in the names GGUF files have too: a
        layer's stacked experts -> each expert's own tensors, in the names and layouts
        of the Llama MLP (``gate_proj`` / ``up_proj`` [out, in] and their biases, from
        the interleaved columns of ``gate_up_proj``), each reading only its slice of
        the stack; the sinks as a ``.weight``; anything else as it is."""
        if tensor.name.endswith(_SINKS):
            return [dataclasses.replace(tensor, name=f"{tensor.name}.weight")]
        found = _STACKED.match(tensor.name)
        if found is None or tensor.quantized:
            return [tensor]
        prefix, projection, bias = found.groups()
        kind = "bias" if bias else "weight"
        parts = (
            [("gate_proj", 0), ("up_proj", 1)]
            if projection == "gate_up_proj"
            else [("down_proj", None)]
        )
        out = []
        for expert in range(tensor.shape[0]):
            one = tensor.narrow(0, expert, 1)
            for name, column in parts:
                out.append(_expert_tensor(one, f"{prefix}.{expert}.{name}.{kind}", column))
        return out


def _expert_tensor(one: CheckpointTensor, name: str, column: int | None) -> CheckpointTensor:
    """One expert's matrix [out, in] (or bias [out]) from its slice [1, in, out] of the
    stack: every second column from ``column`` (gate 0, up 1), or all of them."""
    shape = one.shape[1:]
    if column is not None:
        shape = (*shape[:-1], shape[-1] // 2)
    if len(shape) == 2:
        shape = (shape[1], shape[0])

    def read() -> torch.Tensor:
        data = one.read()[0]
        if column is not None:
            data = data[..., column::2]
        return data.t().contiguous() if data.dim() == 2 else data.contiguous()

    return CheckpointTensor(name, shape, one.file, None, read)


def _read_gguf_keys(reader, config: dict) -> None:
    """The experts' size is the file's expert_feed_forward_length; YaRN untruncated."""
    config["intermediate_size"] = reader._required("expert_feed_forward_length")
    if config.get("rope_scaling"):
        config["rope_scaling"]["truncate"] = False


def _write_gguf_keys(writer, config: ModelConfig) -> None:
    """llama.cpp's gpt-oss reads the window from the file and fixes the rest: even
    layers slide, the SwiGLU's alpha 1.702 and limit 7. A model that differs cannot be
    written faithfully."""
    expected = tuple(config.sliding_window if i % 2 == 0 else None
                     for i in range(config.num_layers))  # fmt: skip
    options = config.family_options
    if config.layer_windows() != expected or (
        (options["swiglu_alpha"], options["swiglu_limit"]) != (1.702, 7.0)
    ):
        raise ModelLoadError(
            "this gpt-oss config differs from what llama.cpp's gpt-oss assumes (even "
            "layers sliding, the others not; swiglu_alpha 1.702, swiglu_limit 7.0): it "
            "cannot be exported faithfully"
        )
    writer.add_sliding_window(config.sliding_window)


GPT_OSS = Family(
    "gpt-oss",
    ("GptOssForCausalLM",),
    GptOssForCausalLM,
    gguf_architecture="gpt-oss",
    gguf_has_experts=True,
    gguf_layer_names={
        "ffn_norm": None,  # (the norm before the mixture is the one after attention)
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
        "ffn_gate_inp": "mlp.router",
    },
    gguf_read_keys=_read_gguf_keys,
    gguf_write_keys=_write_gguf_keys,
)
