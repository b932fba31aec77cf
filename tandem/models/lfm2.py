"""LFM2 (LiquidAI): short gated convolutions beside attention.

Most layers mix tokens with a short convolution gated on both sides; the others attend
(GQA, each head's q and k RMS-normed, Llama's rotary); every layer has Llama's gated
MLP behind its own norm. As transformers' ``Lfm2ForCausalLM`` computes it, a
convolution layer is

    x -> in_proj -> [B | C | x']
    y = C * causal_conv(B * x')      (depthwise, ``conv_L_cache`` taps: 3)
    out_proj(y)

A convolution layer keeps no K/V: each running sequence holds its window (the last two
values of B * x' per channel) in a slot of the state cache (runner/state_cache.py),
and speculative decoding rolls the window back to the last accepted token. The final
norm is ``embedding_norm`` (``token_embd_norm`` in GGUF files); norms scale by their
weight (Llama's).

The MLP's width is the config's ``intermediate_size`` (or ``block_ff_dim``) adjusted
as the checkpoint's code does when ``block_auto_adjust_ff_dim``: two thirds of it,
times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``.

GGUF files (llama.cpp's ``lfm2``): ``head_count_kv`` per layer, 0 for a convolution
layer; ``shortconv.l_cache``; the MLP's width as adjusted; the taps [hidden, width]
float32 (llama-quantize leaves them so).

LFM2-MoE (``Lfm2MoeForCausalLM``) is the same network with each MLP after the first
``num_dense_layers`` a mixture (models/moe.py) routed by the sigmoid of each expert's
logit, the top k of those plus a selection bias (``expert_bias``); its dense MLPs take
``intermediate_size`` as it is. GGUF ``lfm2moe``: ``leading_dense_block_count``,
``expert_gating_func`` 2 (sigmoid), the bias as ``exp_probs_b``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.kernels import cpu as cpu_kernels
from tandem.kernels.causal_conv import convolve
from tandem.models.config import ModelConfig, MoEConfig, require
from tandem.models.family import Family
from tandem.models.gated_delta_net import DepthwiseConv
from tandem.models.layers import AttentionContext, RMSNorm
from tandem.models.linear import Linear
from tandem.models.llama import (
    GatedMLP,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    parse_llama_config,
)
from tandem.models.moe import SparseMoE

CONV, FULL = "conv", "full_attention"


def _mlp_width(raw: dict[str, Any]) -> int:
    size = require(raw, "block_ff_dim", "intermediate_size")
    if not raw.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = raw.get("block_multiple_of") or 256
        size = multiple * -(-int(multiplier * size) // multiple)
    return size


def parse_lfm2_config(raw: dict[str, Any]) -> ModelConfig:
    num_layers = require(raw, "num_hidden_layers")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        attending = raw.get("full_attn_idxs")
        attending = range(num_layers) if attending is None else set(attending)
        layer_types = [FULL if i in attending else CONV for i in range(num_layers)]
    if set(layer_types) - {CONV, FULL} or len(layer_types) != num_layers:
        raise ModelLoadError(f"LFM2 layer_types must name {num_layers} of {CONV}, {FULL}")
    width = raw.get("conv_L_cache") or 3
    if width < 2:
        raise ModelLoadError(f"LFM2 conv_L_cache must be at least 2 (got {width})")
    moe = None
    if raw.get("num_experts"):  # LFM2-MoE: sigmoid routing, after num_dense_layers dense ones
        moe = MoEConfig(
            num_experts=raw["num_experts"],
            top_k=require(raw, "num_experts_per_tok"),
            intermediate_size=require(raw, "moe_intermediate_size"),
            normalize_top_k=bool(raw.get("norm_topk_prob", True)),
            dense_layers=tuple(range(raw.get("num_dense_layers", 2))),
            scoring="sigmoid",
            selection_bias=bool(raw.get("use_expert_bias", True)),
            normalize_epsilon=1e-6,
            routed_scaling=float(raw.get("routed_scaling_factor") or 1.0),
        )
    text = {
        **raw,
        # (LFM2-MoE's dense MLPs take intermediate_size as it is)
        "intermediate_size": require(raw, "intermediate_size") if moe else _mlp_width(raw),
        "rms_norm_eps": raw.get("norm_eps") or raw.get("rms_norm_eps") or 1e-5,
        "rope_theta": raw.get("rope_theta") or 1_000_000.0,
        "tie_word_embeddings": raw.get("tie_embedding", raw.get("tie_word_embeddings", True)),
    }
    return parse_llama_config(
        text,
        moe=moe,
        max_position_embeddings=raw.get("max_position_embeddings") or 128_000,
        qk_norm=True,
        recurrent_layers=tuple(i for i, kind in enumerate(layer_types) if kind == CONV),
        recurrent_state=((require(raw, "hidden_size"), width - 1),),
        family_options={"conv_width": width, "conv_bias": bool(raw.get("conv_bias"))},
    )


class ShortConv(nn.Module):
    """The gated short convolution: out_proj(C * conv(B * x)), its window per
    sequence in the state cache."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.family_options["conv_bias"]
        self.layer_idx = layer_idx
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias)
        self.conv = DepthwiseConv(hidden, config.family_options["conv_width"], bias=bias)
        self.out_proj = Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        bcx = self.in_proj(x)
        batch = attn.recurrent
        (windows,) = batch.states(self.layer_idx)
        if batch.decodes and bcx.dtype == torch.float32 and cpu_kernels.usable(windows):
            y = torch.empty(x.shape, dtype=torch.float32)  # (the fused layer's kernel)
            bias = self.conv.bias if self.conv.bias is not None else torch.empty(0)
            cpu_kernels.load().short_conv_step(
                y, bcx.contiguous(), self.conv.weight.float().contiguous(), bias.float(),
                windows, batch.slots,
            )  # fmt: skip
            return self.out_proj(y)
        b, c, h = bcx.chunk(3, dim=-1)
        y, after = convolve(b * h, self.conv.weight, windows, batch)
        if self.conv.bias is not None:
            y = y + self.conv.bias.to(y.dtype)
        for slot, kept in after.items():  # a verifying sequence: its window, to go back
            batch.rollbacks.setdefault(slot, []).append(
                functools.partial(_restore, windows, slot, kept)
            )
        return self.out_proj(c * y)


def _restore(windows: torch.Tensor, slot: int, after: torch.Tensor, accepted: int) -> None:
    """Speculation's rollback: the slot's window as after its first ``accepted`` tokens."""
    windows[slot] = after[accepted - 1]


class Lfm2ConvLayer(nn.Module):
    """A convolution layer: the gated short convolution, then Llama's gated MLP, each
    behind its norm (the attention layers are Llama's: ``decoder_layer``)."""

    rotary_index = 0

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.conv = ShortConv(config, layer_idx)
        sparse = config.is_moe_layer(layer_idx)
        self.mlp = SparseMoE(config, GatedMLP) if sparse else GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, h, residual, rotary, rope, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block over the residual stream (LlamaDecoderLayer's contract); a
        decode step on the CPU kernels may run it whole in one call."""
        fused = getattr(attn, "decode_layer", None)
        if fused is not None:
            out = fused.short_conv_layer(self, h, residual, attn.recurrent)
            if out is not None:
                return out
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.post_attention_layernorm(self.conv(h, attn), residual)
        return self.mlp(h), residual


def decoder_layer(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``: a convolution layer, or Llama's (GQA with q/k norms: LFM2's
    attention layers are Llama's, whole-layer decode included)."""
    if layer_idx in config.recurrent_layers:
        return Lfm2ConvLayer(config, layer_idx)
    return LlamaDecoderLayer(config, layer_idx)


# Hugging Face's names of LFM2's parts -> the Llama modules that hold them (an
# MLP's w1, w3, w2, an expert's too: _PROJECTIONS).
_RENAMED = {
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".feed_forward.": ".mlp.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    "model.embedding_norm.": "model.norm.",
}


_PROJECTIONS = re.compile(r"(\.mlp\.(?:experts\.\d+\.)?)(w[123])\.")
_PROJECTION_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Lfm2ForCausalLM(LlamaForCausalLM):
    """Llama's model with LFM2's layers; checkpoint names mapped onto Llama's modules
    (``_RENAMED``), q/k/v and gate/up fused as Llama's."""

    layer_class = decoder_layer

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_lfm2_config(raw)

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        name = name.replace(".feed_forward.exp_probs_b.bias", ".mlp.expert_bias")  # (GGUF's)
        for old, new in _RENAMED.items():
            name = name.replace(old, new)
        name = _PROJECTIONS.sub(lambda m: f"{m[1]}{_PROJECTION_NAMES[m[2]]}.", name)
        return super().checkpoint_target(name)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".conv.conv.weight") and tensor.dim() == 3:
            return tensor[:, 0]  # Conv1d's [channels, 1, width]
        return tensor


def _read_gguf_keys(reader, config: dict) -> None:
    """Which layers convolve (head_count_kv 0), the taps' width; the MLP's width as the
    file states it (already adjusted)."""
    per_layer = reader._arch("attention.head_count_kv")
    if not isinstance(per_layer, list) or len(per_layer) != config["num_hidden_layers"]:
        raise ModelLoadError(
            f"{reader.path.name}: lfm2 files state attention.head_count_kv per layer "
            "(0 for a convolution layer)"
        )
    config.update(
        layer_types=[CONV if heads == 0 else FULL for heads in per_layer],
        conv_L_cache=reader._required("shortconv.l_cache"),
        block_auto_adjust_ff_dim=False,
    )
    if config.get("num_experts"):  # lfm2moe: sigmoid routing after the dense layers
        if reader._arch("expert_gating_func") != SIGMOID_GATING:
            raise ModelLoadError(f"{reader.path.name}: lfm2moe routes by sigmoid (gating 2)")
        config.update(
            num_dense_layers=reader._arch("leading_dense_block_count") or 0,
            use_expert_bias=any(n.endswith(".exp_probs_b.bias") for n in reader.tensor_names),
        )


SIGMOID_GATING = 2  # llama.cpp's expert_gating_func for sigmoid scores


def _write_gguf_keys(writer, config: ModelConfig) -> None:
    writer.add_uint32(f"{writer.arch}.shortconv.l_cache", config.family_options["conv_width"])
    if config.moe is not None:
        if config.moe.routed_scaling != 1.0:  # (llama.cpp's lfm2moe graph has none)
            raise ModelLoadError(
                "llama.cpp's lfm2moe scales no routing weights: a routed_scaling_factor "
                f"of {config.moe.routed_scaling} cannot be exported faithfully"
            )
        writer.add_uint32(f"{writer.arch}.leading_dense_block_count", len(config.moe.dense_layers))
        writer.add_uint32(f"{writer.arch}.expert_gating_func", SIGMOID_GATING)


def _write_gguf_tensor(name: str, t: torch.Tensor, config: ModelConfig):
    """The conv taps as llama.cpp holds them ([hidden, width]); a mixture's parts in
    the names the writer stacks and maps (LFM2-MoE)."""
    if name.endswith(".conv.conv.weight") and t.dim() == 3:
        t = t.reshape(t.shape[0], -1)
    if ".feed_forward.experts." in name or ".feed_forward.gate." in name:
        name = name.replace(".feed_forward.", ".mlp.")
        name = _PROJECTIONS.sub(lambda m: f"{m[1]}{_PROJECTION_NAMES[m[2]]}.", name)
    elif name.endswith(".feed_forward.expert_bias"):
        name = name.replace(".expert_bias", ".exp_probs_b.bias")
    return name, t


_GGUF = dict(
    gguf_kv_heads_per_layer=True,
    gguf_global_names={"token_embd_norm": "model.embedding_norm", "output_norm": None},
    gguf_layer_names={
        "attn_norm": "operator_norm",
        "ffn_norm": "ffn_norm",
        "attn_output": "self_attn.out_proj",
        "attn_q_norm": "self_attn.q_layernorm",
        "attn_k_norm": "self_attn.k_layernorm",
        "ffn_gate": "feed_forward.w1",
        "ffn_up": "feed_forward.w3",
        "ffn_down": "feed_forward.w2",
        "shortconv.conv": "conv.conv",
        "shortconv.in_proj": "conv.in_proj",
        "shortconv.out_proj": "conv.out_proj",
        "exp_probs_b": "feed_forward.exp_probs_b",  # (LFM2-MoE's selection bias)
    },
    gguf_read_keys=_read_gguf_keys,
    gguf_write_keys=_write_gguf_keys,
    gguf_write_tensor=_write_gguf_tensor,
)
LFM2 = Family(
    "LFM2", ("Lfm2ForCausalLM", "LFM2ForCausalLM"), Lfm2ForCausalLM, gguf_architecture="lfm2",
    **_GGUF,
)  # fmt: skip
# LFM2-MoE (8B-A1B): LFM2's layers, each MLP after the first num_dense_layers a mixture
# routed by sigmoid scores and a selection bias (models/moe.py); GGUF lfm2moe.
LFM2_MOE = Family(
    "LFM2-MoE", ("Lfm2MoeForCausalLM",), Lfm2ForCausalLM, gguf_architecture="lfm2moe",
    gguf_has_experts=True, gguf_leading_dense=True, **_GGUF,
)  # fmt: skip
