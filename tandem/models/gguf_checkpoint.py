"""A GGUF file (llama.cpp's format) as a checkpoint: its config, tensor names and data.

A GGUF file carries everything a Hugging Face folder does, under llama.cpp's names:
the architecture's shape as metadata keys (``llama.block_count``...), the tokenizer
(gguf_tokenizer.py), and tensors named ``blk.N.attn_q.weight``, each stored as float
or as one of the block formats of tandem/quant/blocks.py. ``GGUFCheckpoint`` turns the
metadata into a config.json-shaped dict, so the model classes parse it as they parse
any checkpoint, and yields each tensor under its Hugging Face name, lazily
(weight_source.CheckpointTensor), its rows read from the mapped file on demand.

llama.cpp's converter reorders the rows of q and k for the llama architecture (its
rotary pairs dimension i with i + 1, Hugging Face's with i + d/2); ``tensors`` puts
them back, as transformers' GGUF loader does. Whole rows move, so quantized rows are
reordered without decoding them. For Gemma the converter stored each norm weight plus
one (the ``1 + weight`` Gemma's norm multiplies by); ``tensors`` takes the one off,
as transformers' GGUF loader does.

The file is read by gguf_file.py (the ``gguf`` package's reader is too slow for a
262k-token vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tandem.errors import ModelLoadError
from tandem.models.family import Family
from tandem.models.gguf_file import TensorInfo
from tandem.models.gguf_split import open_gguf, split_parts
from tandem.models.registry import GGUF_ARCHITECTURES, gguf_family
from tandem.models.weight_source import CheckpointTensor
from tandem.quant.blocks import (
    FLOAT_TYPES,
    GGMLType,
    check_supported,
    dequantize_other,
    held_exactly,
    type_name,
)

# GGUF tensor names -> Hugging Face's (a family's own differences: Family.gguf_layer_names).
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    # A mixture's shared expert (Qwen2-MoE) and its gate: one row, which the file
    # keeps as a vector of hidden_size.
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A mixture's experts, stacked in one tensor each [experts, rows, columns]: each
# expert is read as a tensor of its own, ``mlp.experts.E.<projection>``.
EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
    "ffn_gate_up_exps": "gate_up_proj",  # (gate rows, then up: Gemma 4's converter's)
}
# (a few layer tensors have no .weight: Gated DeltaNet's ssm_a; some names have a dot:
# LFM2's shortconv.in_proj)
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")


def layer_names(family: Family | None) -> dict[str, str]:
    """GGUF layer tensor names -> Hugging Face's, for ``family`` (None: the common ones;
    a family's None drops a common name it does not use)."""
    if family is None:
        return LAYER_NAMES
    names = {**LAYER_NAMES, **family.gguf_layer_names}
    return {gguf: hf for gguf, hf in names.items() if hf is not None}


def global_names(family: Family | None) -> dict[str, str]:
    """GGUF names of the tensors outside the layers -> Hugging Face's (as layer_names)."""
    names = {**GLOBAL_NAMES, **(family.gguf_global_names if family else {})}
    return {gguf: hf for gguf, hf in names.items() if hf is not None}


def hf_name(name: str, family: Family | None = None) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a
    tensor tandem does not use."""
    match = _LAYER_TENSOR.fullmatch(name)
    if match:
        layer, part, kind = match.groups()
        if part in EXPERT_NAMES:  # {expert} is filled in per expert
            return f"model.layers.{layer}.mlp.experts.{{expert}}.{EXPERT_NAMES[part]}.{kind}"
        names = layer_names(family)
        if part not in names:
            return None
        suffix = f".{kind}" if kind else ""
        return f"model.layers.{layer}.{names[part]}{suffix}"
    base, _, kind = name.rpartition(".")
    names = global_names(family)
    return f"{names[base]}.{kind}" if base in names else None


def _unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation ([heads, 2, d/2] -> [heads, d/2, 2] order)."""
    rows = t.shape[0]
    half = rows // heads // 2
    return t.reshape(heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file = open_gguf(self.path)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc}") from None
        self.architecture = str(self.value("general.architecture", ""))
        family = gguf_family(self.architecture, bool(self._arch("expert_count")))
        if family is None:
            raise ModelLoadError(
                f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
            )
        self.family: Family = family
        self.tensor_names = {t.name for t in self._file.tensors}
        # Tensors ``tensors`` decoded to float32 as they were read, by type name (those
        # of a type without a kernel layout, quant/blocks.py's decoded_at_load, and
        # those whose blocks the layouts do not hold exactly: blocks.held_exactly).
        self.decoded: dict[str, int] = {}

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def value(self, key: str, default: Any = None) -> Any:
        return self._file.fields.get(key, default)

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.architecture}.{key}", default)

    def _required(self, key: str) -> Any:
        value = self._arch(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name} has no {self.architecture}.{key}")
        if isinstance(value, list) and key in self.family.gguf_per_layer_keys:
            return value[0]  # (the family's gguf_read_keys reads them all)
        if isinstance(value, list):  # per-layer values: tandem's models use one
            if len(set(value)) != 1:
                raise ModelLoadError(
                    f"{self.path.name}: {self.architecture}.{key} differs between layers "
                    "(not supported)"
                )
            value = value[0]
        return value

    def tensor_info(self, name: str) -> TensorInfo | None:
        return next((t for t in self._file.tensors if t.name == name), None)

    def float_tensor(self, name: str) -> torch.Tensor:
        """A float32 or float16 tensor of the file (a small one: rope_freqs), as float32."""
        info = self.tensor_info(name)
        if info is None or info.type not in FLOAT_TYPES:
            raise ModelLoadError(f"{self.path.name}: {name} is missing or not a float tensor")
        data = torch.from_numpy(self._file.data(info)).view(FLOAT_TYPES[GGMLType(info.type)])
        return data.float().reshape(tuple(reversed(info.shape)))

    def _kv_heads(self, heads: int) -> int:
        """The attention layers' KV heads: ``head_count_kv`` (absent: ``heads``), one
        count, or one per layer where 0 marks a layer without attention (LFM2's)."""
        value = self._arch("attention.head_count_kv")
        if value is None:
            return heads
        if self.family.gguf_kv_heads_per_layer and isinstance(value, list):
            counts = {count for count in value if count}
            if len(counts) != 1:
                raise ModelLoadError(
                    f"{self.path.name}: {self.architecture}.attention.head_count_kv states "
                    f"{sorted(counts) or 'no'} KV head counts (one is supported)"
                )
            return counts.pop()
        return self._required("attention.head_count_kv")

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a config.json dict for the model classes' parse_config."""
        if "rope_freqs.weight" in self.tensor_names and not self.family.gguf_rope_freqs:
            raise ModelLoadError(
                f"{self.path.name} scales rotary frequencies by a rope_freqs tensor "
                "(Llama 3.1-style rope), which the GGUF loader does not read yet"
            )
        heads = self._required("attention.head_count")
        hidden = self._required("embedding_length")
        tokens = self.value("tokenizer.ggml.tokens")
        vocab = self._arch("vocab_size") or (len(tokens) if tokens is not None else None)
        if vocab is None:
            raise ModelLoadError(f"{self.path.name} states no vocabulary size")
        experts = self._arch("expert_count") or 0
        architecture = self.family.architectures[0]
        config: dict[str, Any] = {
            "architectures": [architecture],
            "hidden_size": hidden,
            "num_hidden_layers": self._required("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._kv_heads(heads),
            "head_dim": self._arch("attention.key_length") or hidden // heads,
            # (a mixture with no dense MLP may state only its experts' size)
            "intermediate_size": self._required(
                "feed_forward_length"
                if self._arch("feed_forward_length") is not None
                else "expert_feed_forward_length"
            ),
            "max_position_embeddings": self._arch("context_length", 2048),
            "rms_norm_eps": self._arch("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._arch("rope.freq_base", 10000.0),
            "vocab_size": vocab,
            # The converter writes output.weight only when it is not the embedding.
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.value("tokenizer.ggml.eos_token_id"),
            "sliding_window": self._arch("attention.sliding_window"),
        }
        if experts:
            # llama.cpp's graphs make every layer sparse.
            config.update(
                num_experts=experts,
                num_local_experts=experts,
                num_experts_per_tok=self._required("expert_used_count"),
                moe_intermediate_size=self._arch("expert_feed_forward_length"),
                norm_topk_prob=self.family.gguf_renormalizes_experts,
            )
            if self.family.gguf_shared_expert:
                config["shared_expert_intermediate_size"] = self._required(
                    "expert_shared_feed_forward_length"
                )
        elif self.family.gguf_has_experts:
            raise ModelLoadError(f"{self.path.name} has no {self.architecture}.expert_count")
        rotary = self._arch("rope.dimension_count")
        if rotary is not None and rotary != config["head_dim"]:
            config["partial_rotary_factor"] = rotary / config["head_dim"]
        scaling = self._arch("rope.scaling.type")
        if scaling not in (None, "none"):
            config["rope_scaling"] = {
                "rope_type": scaling,
                "factor": self._arch("rope.scaling.factor", 1.0),
                "original_max_position_embeddings": self._arch(
                    "rope.scaling.original_context_length"
                ),
            }
            for key in ("beta_fast", "beta_slow"):
                if self._arch(f"rope.scaling.yarn_{key}") is not None:
                    config["rope_scaling"][key] = self._arch(f"rope.scaling.yarn_{key}")
        if self.family.gguf_read_keys is not None:
            self.family.gguf_read_keys(self, config)
        return config

    def tensors(self) -> Iterator[CheckpointTensor]:
        """Every tensor tandem uses, lazily (CheckpointTensor: read on demand, pages
        released after)."""
        heads = {}
        if self.family.gguf_permuted_qk:
            config = self.hf_config()
            heads = {
                "attn_q": config["num_attention_heads"],
                "attn_k": config["num_key_value_heads"],
            }
        for info in self._file.tensors:
            name = hf_name(info.name, self.family)
            if name is None:
                continue
            code = check_supported(info.type, info.name)
            shape = tuple(reversed(info.shape))
            kind = type_name(code)
            if isinstance(code, GGMLType) and not held_exactly(code, self._file.data(info)):
                kind, code = f"{kind} (scales beyond float16)", int(code)
            if not isinstance(code, GGMLType):  # decoded to float32 as it is read
                self.decoded[kind] = self.decoded.get(kind, 0) + 1
                code = GGMLType.F32
            if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
                shape = (1, shape[0])  # the vector of one output row
            if "{expert}" not in name:
                yield CheckpointTensor(
                    name, shape, self.path.name, code,
                    functools.partial(self._read, info, code, shape, name, heads),
                    functools.partial(self._file.release, info),
                )  # fmt: skip
                continue
            if len(shape) == 2:  # the experts' biases (gpt-oss): a vector each
                yield from self._expert_vectors(info, code, shape, name)
                continue
            experts, rows, columns = shape
            stacked = CheckpointTensor(
                name, (experts * rows, columns), self.path.name, code,
                functools.partial(self._read, info, code, (experts * rows, columns), name, {}),
                functools.partial(self._file.release, info),
            )  # fmt: skip
            for expert in range(experts):
                part = stacked.narrow(0, expert * rows, rows)
                yield dataclasses.replace(part, name=name.format(expert=expert))

    def _expert_vectors(self, info: TensorInfo, code, shape, name: str):
        """A stack of one vector per expert [experts, size] (float) -> each vector."""
        read = functools.partial(self._read, info, code, shape, name, {})
        for expert in range(shape[0]):
            yield CheckpointTensor(
                name.format(expert=expert), (shape[1],), self.path.name, code,
                lambda expert=expert: read()[expert],
                functools.partial(self._file.release, info),
            )  # fmt: skip

    def _read(
        self, info: TensorInfo, code: GGMLType, shape: tuple[int, ...], name: str, heads: dict
    ) -> torch.Tensor:
        """A view of the mapped bytes; a copy only where rows move (q / k), values
        change (Gemma's norms) or a type is decoded at load (float32 of ``shape``)."""
        if code in FLOAT_TYPES and info.type not in FLOAT_TYPES:  # decoded at load
            data = dequantize_other(info.type, self._file.data(info), shape)
        elif code in FLOAT_TYPES:
            data = torch.from_numpy(self._file.data(info)).view(FLOAT_TYPES[code]).reshape(shape)
        else:
            data = torch.from_numpy(self._file.data(info))
            data = data.reshape(shape[0] if len(shape) > 1 else 1, -1)
        part = info.name.split(".")[-2]
        if part in heads:
            data = _unpermute_rows(data, heads[part])
        if (
            self.family.gguf_norm_plus_one
            and name.endswith("norm.weight")
            and part not in self.family.gguf_plain_norms
        ):
            data = data - 1
        return data


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or a folder's only .gguf file (or
    the first part of its only split model)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1 and files == split_parts(files[0]):
            return files[0]
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise ModelLoadError(f"{path} holds several GGUF files ({names}); pass one of them")
        return files[0] if files else None
    return None
