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
  matrices are read from it as tensors of their own (``checkpoint_tensors``); OpenAI's
  files hold them as MXFP4 (``_blocks`` and ``_scales``), kept in their bits.

GGUF files (llama.cpp's ``gpt-oss``) hold the experts stacked per projection, gate and
up apart, biases stacked likewise, the sinks as ``attn_sinks.weight``; llama.cpp fixes
what the file does not say: even layers slide, the SwiGLU's 1.702 and 7. YaRN is
computed as transformers computes it for this family (its ramp not truncated to whole
dimensions; llama.cpp's ggml truncates it).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig, MoEConfig, require
from tandem.models.family import Family
from tandem.models.layers import AttentionContext, RMSNorm, clamped_swiglu_and_mul
from tandem.models.llama import (
    GatedMLP,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    parse_llama_config,
)
from tandem.models.moe import SparseMoE
from tandem.models.weight_source import CheckpointTensor
from tandem.quant.blocks import BLOCK, GGMLType, dequantize_other, held_exactly
from tandem.quant.openai_mxfp4 import ggml_blocks

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
    """An expert: gate/up and down with biases, the clamped SwiGLU between
    (``swiglu``: its alpha and limit, which the experts' one call takes too:
    runner/linear/experts.py)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        options = config.family_options
        self.swiglu = (options["swiglu_alpha"], options["swiglu_limit"])
        self.act_and_mul = functools.partial(
            clamped_swiglu_and_mul, alpha=self.swiglu[0], limit=self.swiglu[1]
        )


class GptOssAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.sinks = nn.Parameter(torch.empty(config.num_heads))

    def attend(self, attn: AttentionContext, q, k, v) -> torch.Tensor:
        return attn.attend(self.cache_index, q, k, v, self.scale, sinks=self.sinks)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(config, layer_idx)
        self.mlp = SparseMoE(config, ClampedSwiGLU)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)


_SINKS = ".self_attn.sinks"
# A layer's experts in one tensor per projection (Hugging Face's names): float, or
# MXFP4 as OpenAI's blocks and scales (quant/openai_mxfp4.py).
_STACKED = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$"
)
# Each stacked projection's experts as the Llama MLP's tensors: (name, which of the
# interleaved gate/up outputs: 0 gate, 1 up; None: all of them).
_PARTS = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", None),)}


class GptOssForCausalLM(LlamaForCausalLM):
    """Checkpoint names are Hugging Face's, the router read as the mixture's ``gate``
    and each layer's stacked experts split into experts (``checkpoint_tensors``)."""

    layer_class = GptOssDecoderLayer

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_gpt_oss_config(raw)

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        return super().checkpoint_target(name.removesuffix(".weight") if _SINKS in name else name)

    @staticmethod
    def checkpoint_tensors(
        tensors: list[CheckpointTensor], config: ModelConfig | None = None
    ) -> list[CheckpointTensor]:
        """A Hugging Face checkpoint's tensors in the names GGUF files have too: a
        layer's stacked experts -> each expert's own tensors, in the names and layouts
        of the Llama MLP (``gate_proj`` / ``up_proj`` [out, in] and their biases, the
        interleaved outputs of ``gate_up_proj`` apart), each reading only its slice of
        the stack; MXFP4 stacks (``_blocks`` with their ``_scales``) as GGML's MXFP4
        blocks, kept in their bits; the sinks as a ``.weight``; the rest as they are."""
        by_name = {t.name: t for t in tensors}
        out = []
        for tensor in tensors:
            found = _STACKED.match(tensor.name)
            if tensor.name.endswith(_SINKS):
                out.append(dataclasses.replace(tensor, name=f"{tensor.name}.weight"))
            elif found is None or tensor.quantized:
                out.append(tensor)
            elif found.group(3) == "_blocks":
                scales = by_name.get(tensor.name.removesuffix("_blocks") + "_scales")
                if scales is None:
                    raise ModelLoadError(f"{tensor.file}: {tensor.name} has no _scales beside it")
                out += _mxfp4_experts(tensor, scales, *found.groups()[:2])
            elif found.group(3) != "_scales":  # (scales are read with their blocks)
                out += _float_experts(tensor, *found.groups())
        return out


def _float_experts(stack: CheckpointTensor, prefix: str, projection: str, bias: str | None):
    """A float stack [experts, in, out] (a bias: [experts, out]) -> each expert's
    matrices [out, in] (biases [out]), gate and up from alternate outputs."""
    kind = "bias" if bias else "weight"
    for expert in range(stack.shape[0]):
        one = stack.narrow(0, expert, 1)
        for name, column in _PARTS[projection]:
            shape = one.shape[1:]
            if column is not None:
                shape = (*shape[:-1], shape[-1] // 2)

            def read(one=one, column=column) -> torch.Tensor:
                data = one.read()[0]
                if column is not None:
                    data = data[..., column::2]
                return data.t().contiguous() if data.dim() == 2 else data.contiguous()

            full = f"{prefix}.{expert}.{name}.{kind}"
            yield CheckpointTensor(full, tuple(reversed(shape)), one.file, None, read)


def _mxfp4_experts(
    blocks: CheckpointTensor, scales: CheckpointTensor, prefix: str, projection: str
):
    """OpenAI's MXFP4 stack, blocks [experts, out, n, 16] and scales [experts, out, n]
    -> each expert's matrices [out, n * 32] as GGML MXFP4 blocks (gate and up from
    alternate rows); decoded to float32 where the kernels' layouts cannot hold the
    exponents (quant/blocks.py's held_exactly), as a GGUF file's would be."""
    experts, rows, count = scales.shape
    all_scales = scales.read()
    raw = torch.zeros(all_scales.numel(), BLOCK[GGMLType.MXFP4][1], dtype=torch.uint8)
    raw[:, 0] = all_scales.reshape(-1)  # (held_exactly reads a block's exponent only)
    kept = held_exactly(GGMLType.MXFP4, raw)
    del raw, all_scales
    for expert in range(experts):
        own_blocks, own_scales = blocks.narrow(0, expert, 1), scales.narrow(0, expert, 1)
        for name, column in _PARTS[projection]:
            picked = slice(None) if column is None else slice(column, None, 2)
            shape = (len(range(rows)[picked]), count * 32)

            def read(own_blocks=own_blocks, own_scales=own_scales, picked=picked, shape=shape):
                data = ggml_blocks(own_blocks.read()[0][picked], own_scales.read()[0][picked])
                if kept:
                    return data
                return dequantize_other(GGMLType.MXFP4, data.numpy(), shape)

            full = f"{prefix}.{expert}.{name}.weight"
            kind = GGMLType.MXFP4 if kept else GGMLType.F32
            yield CheckpointTensor(full, shape, blocks.file, kind, read)


# Harmony's tokens that end a generation beside the file's EOS (llama.cpp's EOG list):
# a final message's end and a call's.
END_OF_GENERATION = ("<|return|>", "<|call|>")


def _read_gguf_keys(reader, config: dict) -> None:
    """The experts' size is the file's expert_feed_forward_length; YaRN untruncated;
    harmony's <|return|> and <|call|> end a generation too (a file states one EOS)."""
    config["intermediate_size"] = reader._required("expert_feed_forward_length")
    if config.get("rope_scaling"):
        config["rope_scaling"]["truncate"] = False
    tokens = list(reader.value("tokenizer.ggml.tokens") or ())
    ends = [tokens.index(t) for t in END_OF_GENERATION if t in tokens]
    if ends:
        first = [] if config.get("eos_token_id") is None else [config["eos_token_id"]]
        config["eos_token_id"] = list(dict.fromkeys([*first, *ends]))


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
    tensor_parallel=True,
)
