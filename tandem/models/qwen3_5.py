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

GGUF files (llama.cpp's ``qwen35``, its converter's or ``tandem quantize``'s): the norms
stored as 1 + weight (the delta net's as it is), ``ssm_a`` = -exp(A_log), the delta
nets' value heads reordered from grouped to tiled (the layer reads them in that order:
``tiled_value_heads``), its M-RoPE sections (text turns all alike: plain partial rotary).

Qwen3.5-MoE is the same network with every MLP a mixture (models/moe.py: the top k of
a softmax, renormalized, beside a shared expert scaled by sigmoid of its gate).
Qwen3-Next (80B-A3B) is Qwen3.5-MoE with its delta nets' projections stored per key
head (``Qwen3NextForCausalLM``); its GGUF files (``qwen3next``) keep the value heads in
Hugging Face's order and b and a in one tensor.

Checkpoints: ``Qwen3_5ForCausalLM`` folders name the layers ``model.layers.N``; the
published ``Qwen3_5ForConditionalGeneration`` ones (text and vision) hold the text model
under ``model.language_model`` and its config under ``text_config``: read as the text
model, the vision tower left out (images are the vision issue's).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, ClassVar

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig, MoEConfig, require
from tandem.models.family import Family
from tandem.models.gated_delta_net import GatedDeltaNet, delta_net_shapes
from tandem.models.gemma3 import GemmaRMSNorm
from tandem.models.layers import RotaryEmbedding, RotaryPositions
from tandem.models.linear import Linear, MergedLinear
from tandem.models.llama import GatedMLP, LlamaForCausalLM, parse_llama_config
from tandem.models.moe import SparseMoE
from tandem.models.weight_source import CheckpointTensor

LINEAR, FULL = "linear_attention", "full_attention"


def parse_qwen3_5_config(raw: dict[str, Any], interleaved_ba: bool = False) -> ModelConfig:
    """Qwen3.5's (and Qwen3-Next's: ``interleaved_ba``, its b and a projections in one,
    interleaved per key head) config.json -> ModelConfig."""
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
        # (a GGUF file's order of the value heads: gguf_checkpoint.py's reader says so)
        "tiled_value_heads": bool(text.get("linear_value_heads_tiled")),
        "interleaved_ba": interleaved_ba,
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
    moe = None
    if text.get("num_experts"):  # Qwen3.5-MoE, Qwen3-Next: (every) layer's MLP a mixture
        step = text.get("decoder_sparse_step") or 1
        dense = set(text.get("mlp_only_layers") or ())
        dense |= {i for i in range(num_layers) if (i + 1) % step}
        moe = MoEConfig(
            num_experts=text["num_experts"],
            top_k=require(text, "num_experts_per_tok"),
            intermediate_size=require(text, "moe_intermediate_size"),
            normalize_top_k=bool(text.get("norm_topk_prob", True)),
            shared_intermediate_size=text.get("shared_expert_intermediate_size") or 0,
            dense_layers=tuple(sorted(dense)),
        )
        text.setdefault("intermediate_size", moe.intermediate_size)  # (no dense MLP)
    return parse_llama_config(
        text,
        moe=moe,
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
        sparse = config.is_moe_layer(layer_idx)
        self.mlp = SparseMoE(config, GatedMLP) if sparse else GatedMLP(config)
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
    layer_class = Qwen3_5DecoderLayer

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_qwen3_5_config(raw)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        if name.startswith(("model.visual.", "mtp.")):
            return None  # the vision tower; multi-token prediction layers
        name = name.replace("model.language_model.", "model.", 1)
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer is not None and int(layer.group(1)) >= self.config.num_layers:
            return None  # (a GGUF file's multi-token prediction layers)
        name = name.replace(".linear_attn.dt.bias", ".linear_attn.dt_bias")  # (GGUF's ssm_dt)
        if name.endswith(".linear_attn.A_log"):
            name = name.removesuffix("_log")  # held as -exp(A_log): convert_checkpoint_tensor
        return super().checkpoint_target(name)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".A_log"):
            return -tensor.float().exp()
        if name.endswith(".conv1d.weight") and tensor.dim() == 3:
            return tensor[:, 0]
        return tensor


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's network, its delta nets' projections stored otherwise:
    q, k, v and z in one tensor interleaved per key head (``in_proj_qkvz``: [q, k, v, z]
    of each key head in turn), read apart as Qwen3.5's ``in_proj_qkv`` and ``in_proj_z``
    (``checkpoint_tensors``: whole rows, so quantized ones too); b and a in another,
    interleaved alike (``in_proj_ba``), held whole and split as the layer runs
    (GatedDeltaNet's ``interleaved_ba``: llama.cpp's ``ssm_ba`` is that tensor)."""

    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        **Qwen3_5ForCausalLM.packed_modules,
        "in_proj_ba": ("in_proj", 2),
    }

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_qwen3_5_config(raw, interleaved_ba=True)

    @staticmethod
    def checkpoint_tensors(
        tensors: list[CheckpointTensor], config: ModelConfig
    ) -> list[CheckpointTensor]:
        o = config.family_options
        key, value = o["key_dim"], o["value_heads"] // o["key_heads"] * o["value_dim"]
        per_head = 2 * key + 2 * value

        def rows(offset: int, size: int) -> list[range]:  # the part's rows in each key head
            starts = range(0, o["key_heads"] * per_head, per_head)
            return [range(start + offset, start + offset + size) for start in starts]

        out = []
        for tensor in tensors:
            if not tensor.name.endswith(".linear_attn.in_proj_qkvz.weight"):
                out.append(tensor)
                continue
            stem = tensor.name.removesuffix("qkvz.weight")
            qkv = tensor.take(0, rows(0, key) + rows(key, key) + rows(2 * key, value))
            z = tensor.take(0, rows(2 * key + value, value))
            out += [
                dataclasses.replace(qkv, name=f"{stem}qkv.weight"),
                dataclasses.replace(z, name=f"{stem}z.weight"),
            ]
        return out


def _read_gguf_keys(reader, config: dict) -> None:
    """The delta nets' shape from llama.cpp's ssm keys; which layers are recurrent; the
    value heads in the converter's tiled order (qwen35; qwen3next's keep Hugging Face's);
    multi-token prediction layers (past ``block_count - nextn_predict_layers``) left out."""
    value_heads = reader._required("ssm.time_step_rank")
    config.update(
        linear_conv_kernel_dim=reader._required("ssm.conv_kernel"),
        linear_key_head_dim=reader._required("ssm.state_size"),
        linear_num_key_heads=reader._required("ssm.group_count"),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=reader._required("ssm.inner_size") // value_heads,
        linear_value_heads_tiled=reader.architecture != "qwen3next",
    )
    config["num_hidden_layers"] -= reader._arch("nextn_predict_layers") or 0
    recurrent = reader._arch("attention.recurrent_layers")
    if recurrent is not None:
        config["layer_types"] = [
            LINEAR if flag else FULL for flag in list(recurrent)[: config["num_hidden_layers"]]
        ]
    else:
        config["full_attention_interval"] = reader._arch("full_attention_interval") or 4


def _write_gguf_keys(writer, config: ModelConfig) -> None:
    """llama.cpp's qwen35 (qwen3next) keys: the delta nets' shape as its ssm keys, which
    layers are recurrent, and qwen35's M-RoPE sections (text positions turn all alike)."""
    o, arch = config.family_options, writer.arch
    for key, value in (
        ("ssm.conv_kernel", o["conv_width"]),
        ("ssm.state_size", o["key_dim"]),
        ("ssm.group_count", o["key_heads"]),
        ("ssm.time_step_rank", o["value_heads"]),
        ("ssm.inner_size", o["value_heads"] * o["value_dim"]),
    ):
        writer.add_uint32(f"{arch}.{key}", value)
    layers = [i in config.recurrent_layers for i in range(config.num_layers)]
    writer.add_array(f"{arch}.attention.recurrent_layers", layers)
    if arch != "qwen3next":
        writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])


def _tiled(t: torch.Tensor, dim: int, o: dict, head_size: int) -> torch.Tensor:
    """Value heads along ``dim`` from Hugging Face's order (grouped by key head) to the
    order llama.cpp's converter writes (tiled: [G0 v0, G1 v0, ..., G0 v1, ...])."""
    groups, per_group = o["key_heads"], o["value_heads"] // o["key_heads"]
    if per_group == 1:
        return t
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], groups, per_group, head_size, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _write_gguf_tensor(name: str, t: torch.Tensor, config: ModelConfig, tiled: bool = True):
    """A Hugging Face tensor as llama.cpp's qwen35 holds it (qwen3next: ``tiled`` False,
    the value heads in Hugging Face's order): (name to write it under, in Hugging Face's
    spelling, or None to leave it out; the tensor)."""
    if name.startswith(("model.visual.", "mtp.")):
        return None, t
    name = name.replace("model.language_model.", "model.", 1)
    if ".linear_attn." not in name:
        return name, t
    o = config.family_options
    if name.endswith(".A_log"):
        name, t = name.removesuffix("_log"), -t.float().exp()
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt.bias")
    elif name.endswith(".conv1d.weight"):
        t = t.reshape(t.shape[0], -1)
    if not tiled:
        return name, t
    key_channels = 2 * o["key_heads"] * o["key_dim"]
    if ".in_proj_qkv." in name or ".conv1d." in name:  # the value rows after q and k
        t = torch.cat([t[:key_channels], _tiled(t[key_channels:], 0, o, o["value_dim"])])
    elif ".in_proj_z." in name:
        t = _tiled(t, 0, o, o["value_dim"])
    elif ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A", ".dt.bias")):
        t = _tiled(t, 0, o, 1)
    elif ".out_proj." in name:
        t = _tiled(t, 1, o, o["value_dim"])
    return name, t


_GGUF_LAYER_NAMES = {
    "ffn_norm": None,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt",
    "ssm_a": "linear_attn.A",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_GGUF = dict(
    gguf_norm_plus_one=True,
    gguf_plain_norms=("ssm_norm",),
    gguf_layer_names=_GGUF_LAYER_NAMES,
    gguf_read_keys=_read_gguf_keys,
    gguf_write_keys=_write_gguf_keys,
    gguf_write_tensor=_write_gguf_tensor,
)
_MIXTURE = dict(gguf_has_experts=True, gguf_shared_expert=True)
QWEN3_5 = Family(
    "Qwen3.5",
    ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    Qwen3_5ForCausalLM,
    gguf_architecture="qwen35",
    **_GGUF,
)
# Qwen3.5-MoE (35B-A3B, 122B-A10B...): every MLP a mixture of experts, the top k of a
# softmax renormalized, beside a shared expert scaled by sigmoid of its gate.
QWEN3_5_MOE = Family(
    "Qwen3.5 MoE",
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    Qwen3_5ForCausalLM,
    gguf_architecture="qwen35moe",
    **_MIXTURE,
    **_GGUF,
)
# Qwen3-Next (80B-A3B): Qwen3.5-MoE's layers, the delta nets' projections interleaved per
# key head (Qwen3NextForCausalLM); GGUF qwen3next: their b and a in one tensor (ssm_ba),
# the value heads in Hugging Face's order.
QWEN3_NEXT = Family(
    "Qwen3-Next",
    ("Qwen3NextForCausalLM",),
    Qwen3NextForCausalLM,
    gguf_architecture="qwen3next",
    **_MIXTURE,
    **{
        **_GGUF,
        "gguf_layer_names": {
            **_GGUF_LAYER_NAMES,
            "ssm_beta": None,
            "ssm_alpha": None,
            "ssm_ba": "linear_attn.in_proj_ba",
        },
        "gguf_write_tensor": functools.partial(_write_gguf_tensor, tiled=False),
    },
)
