"""Granite 4.0-H (IBM, ``GraniteMoeHybrid``): Mamba-2 layers beside attention, every layer
with a shared MLP and, in the MoE models, a mixture beside it.

Most layers mix tokens with the Mamba-2 mixer (models/mamba2.py: its conv window and
SSD state per sequence in the state cache); the others attend (GQA, no biases, with
rotary positions or none: ``position_embedding_type`` "nope"). As transformers'
``GraniteMoeHybridForCausalLM`` computes it, Granite's multipliers scale the stream:

- the embedding by ``embedding_multiplier``; each sublayer's output (mixer, MLP) by
  ``residual_multiplier`` before it joins the stream; attention scores by
  ``attention_multiplier`` (in place of head_dim^-0.5); logits divided by
  ``logits_scaling``.
- The MLP is the shared one (gate and up in one ``input_linear``) plus, where
  ``num_local_experts`` > 0, the mixture: the top k of the router's logits softmaxed
  among themselves (the renormalized top k of a softmax), experts stacked per layer
  (``input_linear`` [E, 2I, H], ``output_linear`` [E, H, I]) and read as each expert's
  own (``checkpoint_tensors``).

Layer types: ``layer_types`` (or ``layers_block_type``) names each layer "mamba" or
"attention" (the published configs), "linear_attention" or "full_attention"
(transformers 5's spelling).
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
from tandem.models.layers import RMSNorm, RotaryEmbedding, RotaryPositions
from tandem.models.llama import (
    GatedMLP,
    LlamaAttention,
    LlamaForCausalLM,
    parse_llama_config,
)
from tandem.models.mamba2 import Mamba2Mixer, mamba2_shapes
from tandem.models.moe import SparseMoE
from tandem.models.weight_source import CheckpointTensor

RECURRENT = ("mamba", "linear_attention")


def parse_granite_hybrid_config(raw: dict[str, Any]) -> ModelConfig:
    num_layers = require(raw, "num_hidden_layers")
    kinds = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * num_layers
    if len(kinds) != num_layers or set(kinds) - {*RECURRENT, "attention", "full_attention"}:
        raise ModelLoadError(
            f"Granite 4.0-H layer_types must name {num_layers} of mamba, attention"
        )
    hidden = require(raw, "hidden_size")
    heads = raw.get("mamba_n_heads") or 128
    inner = (raw.get("mamba_expand") or 2) * hidden
    head_dim = raw.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else head_dim
    if head_dim * heads != inner:
        raise ModelLoadError(
            "Granite 4.0-H: mamba_n_heads x mamba_d_head must be mamba_expand x hidden"
        )
    limit = raw.get("time_step_limit") or (0.0, float("inf"))
    mamba = {
        "heads": heads,
        "head_dim": head_dim,
        "groups": raw.get("mamba_n_groups") or 1,
        "state": raw.get("mamba_d_state") or 256,
        "conv_width": raw.get("mamba_d_conv") or 4,
        "conv_bias": bool(raw.get("mamba_conv_bias", True)),
        "proj_bias": bool(raw.get("mamba_proj_bias", False)),
        "time_step_limit": (_number(limit[0]), _number(limit[1])),
    }
    experts = raw.get("num_local_experts") or 0
    moe = None
    if experts:
        moe = MoEConfig(
            num_experts=experts,
            top_k=require(raw, "num_experts_per_tok"),
            intermediate_size=require(raw, "intermediate_size"),
            normalize_top_k=True,
        )
    options = {
        "shared_intermediate_size": require(raw, "shared_intermediate_size"),
        "mamba": mamba,
        "rope": raw.get("position_embedding_type") == "rope",
        "embedding_multiplier": float(raw.get("embedding_multiplier") or 1.0),
        "residual_multiplier": float(raw.get("residual_multiplier") or 1.0),
        "attention_multiplier": float(raw.get("attention_multiplier") or 1.0),
        "logits_scaling": float(raw.get("logits_scaling") or 1.0),
    }
    return parse_llama_config(
        {
            **raw,
            "intermediate_size": raw.get("intermediate_size")
            or options["shared_intermediate_size"],
        },
        moe=moe,
        recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind in RECURRENT),
        recurrent_state=mamba2_shapes(mamba),
        family_options=options,
    )


def _number(value: Any) -> float:
    """A float of config.json, where transformers 5 writes infinity as
    ``{"__float__": "Infinity"}``."""
    return float(value["__float__"] if isinstance(value, dict) else value)


class GraniteAttention(LlamaAttention):
    """Llama's attention scaled by ``attention_multiplier``, rotary or none (NoPE)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scale = config.family_options["attention_multiplier"]
        self.rotary = config.family_options["rope"]

    def forward(self, x, rotary: RotaryEmbedding, rope: RotaryPositions, attn) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.rotary:
            q, k = rotary.rotate(q, k, rope)
        return self.o_proj(self.attend(attn, q, k, v).reshape(tokens, -1))


class GraniteHybridLayer(nn.Module):
    rotary_index = 0

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        if layer_idx in config.recurrent_layers:
            self.mamba = Mamba2Mixer(config, layer_idx)
        else:
            self.self_attn = GraniteAttention(config, layer_idx)
        self.mlp = SparseMoE(config, GatedMLP) if config.moe is not None else None
        shared = config.family_options["shared_intermediate_size"]
        self.shared_mlp = GatedMLP(dataclasses.replace(config, intermediate_size=shared, moe=None))
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.scale = config.family_options["residual_multiplier"]

    def forward(self, h, residual, rotary, rope, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block over the residual stream (LlamaDecoderLayer's contract); each
        sublayer's output scaled before it joins the stream."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        mixer = self.mamba if hasattr(self, "mamba") else None
        h = mixer(h, attn) if mixer is not None else self.self_attn(h, rotary, rope, attn)
        h, residual = self.post_attention_layernorm(h * self.scale, residual)
        out = self.shared_mlp(h)
        if self.mlp is not None:
            out = out + self.mlp(h)
        return out * self.scale, residual


# The checkpoint's stacked experts and shared MLP: [E, 2I, H] (gate rows, then up),
# [E, H, I]; [2I, H], [H, I].
_STACKED = re.compile(
    r"(model\.layers\.\d+\.)(block_sparse_moe|shared_mlp)\.(input|output)_linear\.weight"
)


class GraniteHybridForCausalLM(LlamaForCausalLM):
    """Llama's model with Granite 4.0-H's layers and multipliers; the checkpoint's mamba,
    attention and norm names are the modules' own, its MLPs read as ``checkpoint_tensors``
    splits them, the router's ``block_sparse_moe.router.layer`` as the mixture's gate."""

    layer_class = GraniteHybridLayer

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_granite_hybrid_config(raw)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (
            self.model.embed_tokens(input_ids) * self.config.family_options["embedding_multiplier"]
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float() / self.config.family_options["logits_scaling"]

    @staticmethod
    def checkpoint_tensors(
        tensors: list[CheckpointTensor], config: ModelConfig
    ) -> list[CheckpointTensor]:
        """The stacked experts as each expert's gate_proj / up_proj / down_proj, the
        shared MLP's input_linear as its gate_proj and up_proj: slices of rows, read
        alone; a GGUF file's A and D [H, 1] and norm [groups, inner / groups] as vectors."""
        out = []
        for tensor in tensors:
            found = _STACKED.fullmatch(tensor.name)
            if tensor.name.endswith(_VECTORS) and len(tensor.shape) == 2:
                out.append(_flat(tensor))
                continue
            if found is None:
                out.append(tensor)
                continue
            prefix, block, kind = found.groups()
            stacked = block == "block_sparse_moe"
            rows = tensor.shape[-2]
            halves = {"gate_proj": range(rows // 2), "up_proj": range(rows // 2, rows)}
            parts = {"down_proj": None} if kind == "output" else halves
            for e in range(tensor.shape[0] if stacked else 1):
                name = prefix + (f"mlp.experts.{e}." if stacked else "shared_mlp.")
                for projection, span in parts.items():
                    if stacked:
                        part = tensor.expert(e, span)
                    else:
                        part = tensor if span is None else tensor.narrow(0, span.start, len(span))
                    out.append(dataclasses.replace(part, name=f"{name}{projection}.weight"))
        return out

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        name = name.replace(".block_sparse_moe.router.layer.", ".mlp.gate.")
        name = name.replace(".mlp.shared_expert.", ".shared_mlp.")  # (GGUF's ffn_*_shexp)
        name = name.replace(".mamba.dt.bias", ".mamba.dt_bias")  # (GGUF's ssm_dt)
        if name.endswith(".mamba.A_log"):
            name = name.removesuffix("_log")  # held as -exp(A_log): convert_checkpoint_tensor
        return super().checkpoint_target(name)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".A_log"):
            return -tensor.float().exp()
        if name.endswith(".conv1d.weight") and tensor.dim() == 3:
            return tensor[:, 0]
        return tensor


_VECTORS = (".mamba.A", ".mamba.D", ".mamba.norm.weight")


def _flat(tensor: CheckpointTensor) -> CheckpointTensor:
    """A float matrix read as the vector of its values."""
    size = tensor.shape[0] * tensor.shape[1]
    return dataclasses.replace(tensor, shape=(size,), _read=lambda: tensor.read().reshape(-1))


_SCALES = {  # llama.cpp's keys of Granite's multipliers
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}


def _read_gguf_keys(reader, config: dict) -> None:
    """Which layers are Mamba-2 (head_count_kv 0), the mixers' shape from the ssm keys,
    the multipliers, rotary or none (rope.scaling.finetuned), the shared MLP's width."""
    per_layer = reader._arch("attention.head_count_kv")
    if not isinstance(per_layer, list):
        per_layer = [config["num_key_value_heads"]] * config["num_hidden_layers"]
    heads = reader._required("ssm.time_step_rank")
    config.update(
        layer_types=["mamba" if count == 0 else "attention" for count in per_layer],
        mamba_n_heads=heads,
        mamba_d_head=reader._required("ssm.inner_size") // heads,
        mamba_expand=reader._required("ssm.inner_size") // config["hidden_size"],
        mamba_d_state=reader._required("ssm.state_size"),
        mamba_n_groups=reader._required("ssm.group_count"),
        mamba_d_conv=reader._required("ssm.conv_kernel"),
        mamba_conv_bias=any(name.endswith("ssm_conv1d.bias") for name in reader.tensor_names),
        position_embedding_type="rope" if reader._arch("rope.scaling.finetuned", True) else "nope",
        # (llama.cpp's graph: no attention.scale is head_dim^-0.5, not 1)
        attention_multiplier=config["head_dim"] ** -0.5,
    )
    for key, name in _SCALES.items():
        if reader._arch(key):
            config[name] = reader._arch(key)
    if config.get("num_local_experts"):  # (feed_forward_length: the experts' width)
        config["shared_intermediate_size"] = reader._required("expert_shared_feed_forward_length")
    else:
        config["shared_intermediate_size"] = config["intermediate_size"]


def _write_gguf_keys(writer, config: ModelConfig) -> None:
    o, arch = config.family_options, writer.arch
    mamba = o["mamba"]
    for key, value in (
        ("ssm.conv_kernel", mamba["conv_width"]),
        ("ssm.state_size", mamba["state"]),
        ("ssm.group_count", mamba["groups"]),
        ("ssm.inner_size", mamba["heads"] * mamba["head_dim"]),
        ("ssm.time_step_rank", mamba["heads"]),
    ):
        writer.add_uint32(f"{arch}.{key}", value)
    for key, name in _SCALES.items():
        writer.add_float32(f"{arch}.{key}", o[name])
    writer.add_bool(f"{arch}.rope.scaling.finetuned", o["rope"])
    if config.moe is not None:  # (feed_forward_length: the experts' width, as llama.cpp's)
        shared = o["shared_intermediate_size"]
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", shared)


def _write_gguf_tensor(name: str, t: torch.Tensor, config: ModelConfig):
    """A tensor (after checkpoint_tensors) as llama.cpp's converter writes it: A as
    -exp(A_log) and D as [H, 1], the norm [groups, inner / groups], the taps
    [channels, width], the shared MLP as ffn_*_shexp beside experts."""
    mamba = config.family_options["mamba"]
    if name.endswith(".mamba.A_log"):
        return name.removesuffix("_log"), -t.float().exp().reshape(-1, 1)
    if name.endswith(".mamba.D"):
        return name, t.reshape(-1, 1)
    if name.endswith(".mamba.dt_bias"):
        return name.replace(".dt_bias", ".dt.bias"), t
    if name.endswith(".mamba.norm.weight"):
        return name, t.reshape(mamba["groups"], -1)
    if name.endswith(".mamba.conv1d.weight"):
        return name, t.reshape(t.shape[0], -1)
    if ".block_sparse_moe.router.layer." in name:
        return name.replace(".block_sparse_moe.router.layer.", ".mlp.gate."), t
    if ".shared_mlp." in name and config.moe is not None:
        return name.replace(".shared_mlp.", ".mlp.shared_expert."), t
    return name, t


GRANITE_HYBRID = Family(
    "Granite 4.0-H",
    ("GraniteMoeHybridForCausalLM",),
    GraniteHybridForCausalLM,
    gguf_architecture="granitehybrid",
    gguf_permuted_qk=True,
    gguf_kv_heads_per_layer=True,
    gguf_layer_names={
        "ssm_in": "mamba.in_proj",
        "ssm_conv1d": "mamba.conv1d",
        "ssm_dt": "mamba.dt",
        "ssm_a": "mamba.A",
        "ssm_d": "mamba.D",
        "ssm_norm": "mamba.norm",
        "ssm_out": "mamba.out_proj",
        # a dense model's only MLP (with experts: ffn_*_shexp, Llama's shared expert)
        "ffn_gate": "shared_mlp.gate_proj",
        "ffn_up": "shared_mlp.up_proj",
        "ffn_down": "shared_mlp.down_proj",
    },
    gguf_read_keys=_read_gguf_keys,
    gguf_write_keys=_write_gguf_keys,
    gguf_write_tensor=_write_gguf_tensor,
)
