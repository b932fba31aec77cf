"""Gemma 4 (text): Gemma 3's sliding and full layers, each kind with its own heads,
per-layer input embeddings, and K/V shared between layers.

What differs from Gemma 3, each as transformers' ``Gemma4ForCausalLM`` computes it:

- Full-attention layers have their own head size (``global_head_dim``, 512 where the
  sliding layers' is 256) and may have fewer KV heads (``num_global_key_value_heads``,
  with ``attention_k_eq_v``: their values are their keys before the key norm, no
  v_proj). ModelConfig.layer_kv_shapes holds them; the paged cache then keeps each
  layer's rows in their own shape (runner/kv_cache.py's LayeredKVCache).
- Full layers turn their heads with "proportional" rope: the first quarter of the pairs
  at a full-head rotary's frequencies, the rest not at all (layers.rope_inv_freq).
- Scores are not scaled (q and k are RMS-normed per head); values are RMS-normed per
  head without a weight. Norms scale by their weight itself (not 1 + weight).
- The last ``num_kv_shared_layers`` layers compute only queries: each attends over the
  K/V of the last earlier layer of its kind (ModelConfig.kv_shared_layers: it keeps no
  cache of its own); with ``use_double_wide_mlp`` their MLPs are twice as wide.
- Per-layer inputs (E2B, E4B): a second embedding table gives each token a
  ``hidden_size_per_layer_input`` vector per layer, mixed with a projection of the
  token's embedding; each layer, after its MLP, adds
  norm(proj(gelu(gate(h)) * that vector)).
- Each layer's output is multiplied by a learned scalar (``layer_scalar``).
- The mixture layers (26B-A4B) run a dense MLP and a mixture side by side, each with
  its own norms; the router reads the stream before those norms (Gemma4Mixture).

Checkpoints: ``Gemma4ForCausalLM`` folders name the layers ``model.layers.N``; the
published ``Gemma4ForConditionalGeneration`` ones (text, vision, audio) hold the text
model under ``model.language_model`` and its config under ``text_config``: read as the
text model, the towers left out (images are the vision issue's).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.kernels import cpu as cpu_kernels
from tandem.models.config import ModelConfig, MoEConfig, parse_rope, require
from tandem.models.family import Family
from tandem.models.gemma3 import Gemma3ForCausalLM, GemmaRMSNorm, rounded_scale
from tandem.models.layers import RotaryEmbedding, RotaryPositions, activation
from tandem.models.linear import Linear, MergedLinear
from tandem.models.llama import GatedMLP, parse_llama_config
from tandem.models.moe import SparseMoE
from tandem.models.weight_source import CheckpointTensor

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def _layer_overrides(text: dict[str, Any], layer_types: list[str]) -> dict[str, Any]:
    """The full layers' head size and KV heads: ``global_head_dim`` and
    ``num_global_key_value_heads`` (the published configs), or the per-layer entries
    transformers writes back (``per_layer_config``)."""
    per_layer = text.get("per_layer_config") or {}
    for index, entry in per_layer.items():
        if layer_types[int(index)] == FULL:
            return dict(entry)
    overrides = {"head_dim": text.get("global_head_dim") or 512}
    # (transformers: the full layers' own KV heads only where their values are keys)
    if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads"):
        overrides["num_key_value_heads"] = text["num_global_key_value_heads"]
    return overrides


def kv_sources(layer_types: list[str], num_shared: int) -> dict[int, int]:
    """Each of the last ``num_shared`` layers -> the last earlier layer of its kind that
    keeps K/V (transformers' kv_sharing_modes)."""
    first_shared = len(layer_types) - num_shared
    sources = {}
    for layer in range(first_shared, len(layer_types)):
        kind = layer_types[layer]
        owners = [i for i in range(first_shared) if layer_types[i] == kind]
        if not owners:
            raise ModelLoadError(f"Gemma 4: no earlier {kind} layer holds K/V for layer {layer}")
        sources[layer] = owners[-1]
    return sources


def parse_gemma4_config(raw: dict[str, Any]) -> ModelConfig:
    text = {**raw, **(raw.get("text_config") or {})}
    text["architectures"] = raw.get("architectures")
    for key in ("eos_token_id", "bos_token_id"):  # (the whole model's: [1, 106], end of turn)
        if raw.get(key) is not None:
            text[key] = raw[key]
    if text.get("use_bidirectional_attention") == "all":
        raise ModelLoadError("Gemma 4 with bidirectional attention (an encoder) is not supported")
    num_layers = require(text, "num_hidden_layers")
    layer_types = list(text.get("layer_types") or [
        SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)
    ])  # fmt: skip
    if set(layer_types) - {SLIDING, FULL} or len(layer_types) != num_layers:
        raise ModelLoadError(f"Gemma 4 layer_types must name {num_layers} of {SLIDING}, {FULL}")
    layer_types[-1] = FULL  # (transformers forces it so)
    head_dim = text.get("head_dim") or 256
    full = _layer_overrides(text, layer_types)
    kv_heads = text.get("num_key_value_heads") or require(text, "num_attention_heads")
    full_shape = (full.get("num_key_value_heads", kv_heads), full["head_dim"])
    ropes = {}
    for kind in (FULL, SLIDING):
        params = {**DEFAULT_ROPE[kind], **((text.get("rope_parameters") or {}).get(kind) or {})}
        size = full_shape[1] if kind == FULL else head_dim
        ropes[kind] = parse_rope({"rope_parameters": params}, size)
    shared = kv_sources(layer_types, text.get("num_kv_shared_layers") or 0)
    options = {
        "local_rope": ropes[SLIDING],
        "final_logit_softcapping": text.get("final_logit_softcapping"),
        "per_layer_input_size": text.get("hidden_size_per_layer_input") or 0,
        "per_layer_vocab_size": text.get("vocab_size_per_layer_input") or text.get("vocab_size"),
        "values_are_keys": bool(text.get("attention_k_eq_v")),
        "double_wide_mlp": bool(text.get("use_double_wide_mlp")),
    }
    full_layers = {i: full_shape for i, kind in enumerate(layer_types) if kind == FULL}
    moe = None
    if text.get("enable_moe_block"):  # (26B-A4B: a mixture beside the MLP in every layer)
        moe = MoEConfig(
            num_experts=require(text, "num_experts"),
            top_k=require(text, "top_k_experts"),
            intermediate_size=require(text, "moe_intermediate_size"),
            normalize_top_k=True,
        )
    return parse_llama_config(
        {**text, "rope_parameters": None, "rope_scaling": None},
        moe=moe,
        head_dim=head_dim,
        num_kv_heads=kv_heads,
        hidden_act=text.get("hidden_activation") or "gelu_pytorch_tanh",
        max_position_embeddings=text.get("max_position_embeddings") or 131072,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
        qk_norm=True,
        rope=ropes[FULL],
        sliding_window=text.get("sliding_window") or 512,
        sliding_layers=tuple(i for i, kind in enumerate(layer_types) if kind == SLIDING),
        layer_kv_shapes=full_layers if full_shape != (kv_heads, head_dim) else {},
        kv_shared_layers=shared,
        family_options=options,
    )


class Gemma4RMSNorm(GemmaRMSNorm):
    """``(x / rms(x) * weight).to(dtype)``, the norm and the scale in float32."""

    offset = 0.0


_ONES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def unscaled_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32, rounded to x's dtype (Gemma 4's
    value norm: no weight); per head of [T, H, D] in one compiled call on a CPU (a
    multiplier of ones: rounded once, as here)."""
    if x.dim() == 3 and x.stride(2) == 1 and cpu_kernels.usable(x):
        key = (x.shape[-1], x.dtype, x.device)
        if key not in _ONES:
            _ONES[key] = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        out = x.new_empty(x.shape)
        cpu_kernels.load().rms_norm_heads(out, x, _ONES[key], eps)
        return out
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4Attention(nn.Module):
    """Queries, and (unless the layer reads another's: ``source``) keys and values
    into ``shared`` for the layers that read them."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.cache_index = config.cache_index(layer_idx)
        self.source = config.kv_shared_layers.get(layer_idx)
        self.keeps = layer_idx in set(config.kv_shared_layers.values())
        self.num_heads = config.num_heads
        self.num_kv_heads, self.head_dim = config.kv_shape(layer_idx)
        full = config.layer_window(layer_idx) is None
        self.values_are_keys = config.family_options["values_are_keys"] and full
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.norm_eps)
        if self.source is None:
            self.split_sizes = [q_size, kv_size] + ([] if self.values_are_keys else [kv_size])
            self.qkv_proj = MergedLinear(config.hidden_size, self.split_sizes, bias=False)
            self.k_norm = Gemma4RMSNorm(self.head_dim, config.norm_eps)
        else:
            self.q_proj = Linear(config.hidden_size, q_size, bias=False)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.eps = config.norm_eps

    def forward(self, x, rotary: RotaryEmbedding, rope: RotaryPositions, attn, shared: dict):
        num_tokens = x.shape[0]
        if self.source is None:
            parts = self.qkv_proj(x).split(self.split_sizes, dim=-1)
            q = parts[0].view(num_tokens, self.num_heads, self.head_dim)
            k = parts[1].view(num_tokens, self.num_kv_heads, self.head_dim)
            v = k if self.values_are_keys else parts[2].view(k.shape)
            v = unscaled_rms_norm(v, self.eps)
            q, k = rotary.rotate(self.q_norm(q), self.k_norm(k), rope)
            if self.keeps:
                shared[self.layer_idx] = (k, v)
        else:
            q = self.q_norm(self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim))
            q, _ = rotary.rotate(q, q[:, :0], rope)
            # The source layer's K/V of this forward; written again to the same slots
            # (the same rows: the attention backend's write is idempotent).
            k, v = shared[self.source]
        out = attn.attend(self.cache_index, q, k, v, 1.0)
        return self.o_proj(out.reshape(num_tokens, -1))


class Gemma4Mixture(SparseMoE):
    """26B-A4B's mixture, beside each layer's MLP: routed from the stream itself
    (normed without a weight, times a learned scale and 1/sqrt(hidden)), the top k of a
    softmax renormalized and each multiplied by its expert's learned scale; the experts
    (GELU-gated MLPs) run on the stream normed by the layer's second pre-MLP norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, GatedMLP)
        self.router_scale = nn.Parameter(torch.empty(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(self.num_experts))
        self.eps, self.root = config.norm_eps, config.hidden_size**-0.5

    def mixed(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The picked experts' weighted sum over ``x`` (the experts' input), routed from
        ``h`` (the stream); on a CPU with packed experts in one call (runner/linear/
        experts.py: the kernel routes from these logits and applies the scales)."""
        logits = self.router_logits(h)
        fused = getattr(self, "fused_experts", None)
        if fused is not None and not torch.is_grad_enabled():
            return fused(self, x, logits)
        return self.routed(x, self.weigh(logits, h.dtype))

    def router_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.gate(unscaled_rms_norm(h, self.eps) * self.router_scale * self.root)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weigh(self.router_logits(h), h.dtype)

    def weigh(self, logits: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.per_expert_scale[chosen]).to(dtype), chosen


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        options = config.family_options
        self.self_attn = Gemma4Attention(config, layer_idx)
        # the model's rotaries: full layers' (0), sliding layers' (1)
        self.rotary_index = 0 if config.layer_window(layer_idx) is None else 1
        wide = options["double_wide_mlp"] and layer_idx in config.kv_shared_layers
        width = config.intermediate_size * (2 if wide else 1)
        self.mlp = GatedMLP(dataclasses.replace(config, intermediate_size=width))
        norm = lambda size=config.hidden_size: Gemma4RMSNorm(size, config.norm_eps)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.per_layer_input_size = size = options["per_layer_input_size"]
        if size:
            self.per_layer_input_gate = Linear(config.hidden_size, size, bias=False)
            self.per_layer_projection = Linear(size, config.hidden_size, bias=False)
            self.post_per_layer_input_norm = norm()
            self.act = activation(config.hidden_act)
        self.layer_scalar = nn.Parameter(torch.empty(1))
        self.experts = None
        if config.moe is not None:
            self.experts = Gemma4Mixture(config)
            self.post_feedforward_layernorm_1 = norm()
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_2 = norm()

    def forward(self, h, per_layer_input, rotary, rope, attn, shared):
        """h: the stream (this layer's input) -> the next layer's input."""
        x = self.self_attn(self.input_layernorm(h), rotary, rope, attn, shared)
        x, h = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), h)
        x = self.mlp(x)
        if self.experts is not None:  # the MLP and the mixture side by side
            mixed = self.experts.mixed(self.pre_feedforward_layernorm_2(h), h)
            x = self.post_feedforward_layernorm_1(x) + self.post_feedforward_layernorm_2(mixed)
        h = h + self.post_feedforward_layernorm(x)
        if self.per_layer_input_size:
            gate = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        options = config.family_options
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Gemma4RMSNorm(config.hidden_size, config.norm_eps)
        assert config.rope is not None
        self.rotaries = nn.ModuleList(  # full layers' rotary, then sliding layers'
            RotaryEmbedding(rope, config.max_position_embeddings)
            for rope in (config.rope, options["local_rope"])
        )
        size = options["per_layer_input_size"]
        if size:
            width = config.num_layers * size
            self.embed_tokens_per_layer = nn.Embedding(options["per_layer_vocab_size"], width)
            self.per_layer_model_projection = Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(size, config.norm_eps)


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Checkpoint names and values are Hugging Face's (q/k/v and gate/up fused as
    Llama's; a layer whose values are its keys has no v_proj)."""

    model_class = Gemma4Model

    @staticmethod
    def parse_config(raw: dict[str, Any]) -> ModelConfig:
        return parse_gemma4_config(raw)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        m = self.model
        h = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, h)
        ropes = [(rotary, rotary.prepare(positions, h.dtype)) for rotary in m.rotaries]
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, layer in enumerate(m.layers):
            if index in self.skipped_layers and not layer.self_attn.keeps:
                continue  # (a layer-skip draft's: layers whose K/V others read still run)
            mine = per_layer[:, index] if per_layer is not None else None
            h = layer(h, mine, *ropes[layer.rotary_index], attn, shared)
        return m.norm(h)

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """[T, layers, per-layer size]: each token's own vector per layer (scaled by
        sqrt of its size) and a normed projection of its embedding, averaged (times
        1/sqrt(2) of their sum); None without per-layer inputs."""
        size = self.config.family_options["per_layer_input_size"]
        if not size:
            return None
        m, shape = self.model, (len(input_ids), self.config.num_layers, size)
        own = m.embed_tokens_per_layer(input_ids) * rounded_scale(size**0.5, h.dtype)
        mixed = m.per_layer_model_projection(h) * (self.config.hidden_size**-0.5)
        mixed = m.per_layer_projection_norm(mixed.view(shape))
        return (mixed + own.view(shape)) * (2.0**-0.5)

    @staticmethod
    def text_name(name: str, config: ModelConfig) -> str | None:
        """A checkpoint tensor's name in the text model (``model.layers.N...``), or None
        for one it does not hold: the towers and their projections (the vision issue's),
        K/V projections of a layer that reads another's (checkpoints may hold them)."""
        if name.startswith(("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                            "model.embed_audio.")):  # fmt: skip
            return None
        name = name.replace("model.language_model.", "model.", 1)
        layer = re.match(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\.", name)
        if layer is not None and int(layer.group(1)) in config.kv_shared_layers:
            return None
        return name

    @staticmethod
    def checkpoint_tensors(
        tensors: list[CheckpointTensor], config: ModelConfig
    ) -> list[CheckpointTensor]:
        """A mixture's stacked experts (``experts.gate_up_proj`` [E, 2I, H], gate rows
        then up; ``experts.down_proj`` [E, H, I]) as each expert's own matrices; a GGUF
        file's expert of ``ffn_gate_up_exps`` as its gate and up rows."""
        out = []
        for tensor in tensors:
            fused = _FUSED_EXPERT.fullmatch(tensor.name)
            if fused is not None:  # (a GGUF stack's expert: ffn_gate_up_exps' rows)
                half = tensor.shape[0] // 2
                for part, start in (("gate_proj", 0), ("up_proj", half)):
                    one = tensor.narrow(0, start, half)
                    out.append(dataclasses.replace(one, name=f"{fused.group(1)}{part}.weight"))
                continue
            found = _STACKED_EXPERTS.fullmatch(tensor.name)
            if found is None:
                out.append(tensor)
                continue
            prefix, projection = found.groups()
            rows = tensor.shape[1]
            parts = (
                {"down_proj": None} if projection == "down_proj"
                else {"gate_proj": range(rows // 2), "up_proj": range(rows // 2, rows)}
            )  # fmt: skip
            for e in range(tensor.shape[0]):
                for part, span in parts.items():
                    name = f"{prefix}experts.experts.{e}.{part}.weight"
                    out.append(dataclasses.replace(tensor.expert(e, span), name=name))
        return out

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        name = self.text_name(name, self.config)
        if name is None:
            return None
        for theirs, ours in _ROUTER_NAMES.items():
            name = name.replace(theirs, ours)
        name = name.replace(".mlp.experts.", ".experts.experts.")  # (GGUF's stacks)
        if name.endswith(".layer_scalar.weight"):  # (GGUF's layer_output_scale)
            return name.removesuffix(".weight"), None
        if re.match(r"model\.layers\.\d+\.self_attn\.q_proj\.", name):
            index = int(name.split(".")[2])
            if index in self.config.kv_shared_layers:
                return name, None  # its own q_proj, not a part of qkv_proj
        return super().checkpoint_target(name)


_STACKED_EXPERTS = re.compile(
    r"(model\.(?:language_model\.)?layers\.\d+\.)experts\.(gate_up_proj|down_proj)"
)
_FUSED_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.\d+\.)gate_up_proj\.weight")
# The router's tensors as Gemma4Mixture holds them.
_ROUTER_NAMES = {
    ".router.proj.": ".experts.gate.",
    ".router.scale": ".experts.router_scale",
    ".router.per_expert_scale": ".experts.per_expert_scale",
}


def _read_gguf_keys(reader, config: dict) -> None:
    """llama.cpp's gemma4 keys: which layers slide (sliding_window_pattern), each kind's
    head size (key_length, key_length_swa) and KV heads (head_count_kv per layer), the
    shared layers and the double-wide MLPs (feed_forward_length per layer), per-layer
    inputs, each kind's rotary base; the full layers' turning pairs from rope_freqs
    (1 where a pair turns, 1e30 where it does not); values that are keys where a full
    layer has no attn_v."""
    arch = reader._arch
    if arch("expert_count"):  # (26B-A4B's mixtures)
        config.update(enable_moe_block=True, top_k_experts=config["num_experts_per_tok"])
    sliding = [bool(s) for s in arch("attention.sliding_window_pattern")]
    layers = config["num_hidden_layers"]
    if len(sliding) != layers:
        raise ModelLoadError(f"{reader.path.name}: sliding_window_pattern is not per layer")
    layer_types = [SLIDING if s else FULL for s in sliding]
    full = [i for i, s in enumerate(sliding) if not s]
    heads_kv = arch("attention.head_count_kv")
    heads_kv = heads_kv if isinstance(heads_kv, list) else [heads_kv] * layers
    head_dim, full_dim = arch("attention.key_length_swa"), arch("attention.key_length")
    shared = arch("attention.shared_kv_layers") or 0
    widths = arch("feed_forward_length")
    widths = widths if isinstance(widths, list) else [widths] * layers
    double = widths[-1] == 2 * widths[0] and shared > 0
    expected = [widths[0] * (2 if double and i >= layers - shared else 1) for i in range(layers)]
    if widths != expected:
        raise ModelLoadError(f"{reader.path.name}: feed_forward_length {widths} is not Gemma 4's")
    turning = int((reader.float_tensor("rope_freqs.weight") < 2).sum())
    swa_rotary = arch("rope.dimension_count_swa") or head_dim
    per_layer = reader.tensor_info("per_layer_token_embd.weight")
    config.pop("partial_rotary_factor", None)
    config.update(
        # (llama.cpp's converter cuts the embedding to the tokenizer's own tokens)
        vocab_size=reader.tensor_info("token_embd.weight").shape[1],
        layer_types=layer_types,
        head_dim=head_dim,
        num_key_value_heads=heads_kv[sliding.index(True)] if any(sliding) else heads_kv[0],
        per_layer_config={
            str(i): {"head_dim": full_dim, "num_key_value_heads": heads_kv[i]} for i in full
        },
        attention_k_eq_v=f"blk.{full[0]}.attn_v.weight" not in reader.tensor_names,
        num_kv_shared_layers=shared,
        use_double_wide_mlp=double,
        intermediate_size=widths[0],
        hidden_size_per_layer_input=arch("embedding_length_per_layer_input") or 0,
        vocab_size_per_layer_input=per_layer.shape[1] if per_layer is not None else None,
        final_logit_softcapping=arch("final_logit_softcapping"),
        rope_parameters={
            FULL: {
                "rope_type": "proportional",
                "partial_rotary_factor": turning / (full_dim // 2),
                "rope_theta": arch("rope.freq_base", 1_000_000.0),
            },
            SLIDING: {
                "rope_type": "default",
                "partial_rotary_factor": swa_rotary / head_dim,
                "rope_theta": arch("rope.freq_base_swa", 10_000.0),
            },
        },
    )


def _write_gguf_keys(writer, config: ModelConfig) -> None:
    """Beyond the common keys (whose head size, MLP width and KV heads are the sliding
    layers'): llama.cpp's gemma4 keys, as its converter writes them."""
    options, arch = config.family_options, writer.arch
    for key in ("feed_forward_length", "attention.key_length", "attention.value_length"):
        writer.kv_data[0].pop(f"{arch}.{key}", None)  # (rewritten below)
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    full_dim = next(config.kv_shape(i)[1] for i, w in enumerate(windows) if w is None)
    local = options["local_rope"]
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([w is not None for w in windows])
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_key_length_swa(config.head_dim)
    writer.add_value_length_swa(config.head_dim)
    writer.add_rope_freq_base_swa(local.theta)
    writer.add_rope_dimension_count_swa(local.rotary_dim)
    writer.add_shared_kv_layers(len(config.kv_shared_layers))
    writer.add_embedding_length_per_layer_input(options["per_layer_input_size"])
    wide = options["double_wide_mlp"]
    writer.add_feed_forward_length([
        config.intermediate_size * (2 if wide and i in config.kv_shared_layers else 1)
        for i in range(config.num_layers)
    ])  # fmt: skip
    if options["final_logit_softcapping"]:
        writer.add_final_logit_softcapping(options["final_logit_softcapping"])


def _write_gguf_tensor(name: str, t: torch.Tensor, config: ModelConfig):
    """A checkpoint tensor as the converter writes it: the text model's only, the layer
    scalar as a weight (layer_output_scale.weight), a mixture's experts as the common
    stacks take them (mlp.experts.E.*)."""
    target = Gemma4ForCausalLM.text_name(name, config)
    if target is None:
        return None, t
    if target.endswith(".layer_scalar"):
        target += ".weight"
    for theirs, ours in _ROUTER_NAMES.items():
        target = target.replace(theirs, ours)
    return target.replace(".experts.experts.", ".mlp.experts."), t


def _extra_tensors(config: ModelConfig) -> dict[str, np.ndarray]:
    """rope_freqs: per pair of the full layers' heads, 1 where it turns and 1e30 where
    it does not (how llama.cpp's rotary leaves the rest of the head as it is)."""
    rope = config.rope
    assert rope is not None
    pairs = rope.rotary_dim // 2
    turning = int(rope.scaling.get("partial_rotary_factor", 1.0) * pairs)
    return {"rope_freqs.weight": np.array([1.0] * turning + [1e30] * (pairs - turning),
                                          dtype=np.float32)}  # fmt: skip


GEMMA4 = Family(
    "Gemma 4",
    ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    Gemma4ForCausalLM,
    gguf_architecture="gemma4",
    gguf_layer_names={
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection",
        "post_norm": "post_per_layer_input_norm",
        "layer_output_scale": "layer_scalar",
        # 26B-A4B's mixture: its router (ffn_gate_inp and its .scale), each expert's
        # output scale (ffn_down_exps.scale), the norms around it
        "ffn_gate_inp": "experts.gate",
        "ffn_gate_inp.scale": "experts.router_scale",
        "ffn_down_exps.scale": "experts.per_expert_scale",
        "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
        "post_ffw_norm_1": "post_feedforward_layernorm_1",
        "post_ffw_norm_2": "post_feedforward_layernorm_2",
    },
    gguf_global_names={
        "per_layer_token_embd": "model.embed_tokens_per_layer",
        "per_layer_model_proj": "model.per_layer_model_projection",
        "per_layer_proj_norm": "model.per_layer_projection_norm",
    },
    gguf_per_layer_keys=("feed_forward_length", "attention.head_count_kv"),
    gguf_rope_freqs=True,
    gguf_read_keys=_read_gguf_keys,
    gguf_write_keys=_write_gguf_keys,
    gguf_write_tensor=_write_gguf_tensor,
    gguf_extra_tensors=_extra_tensors,
)
