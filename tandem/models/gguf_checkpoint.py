"""A GGUF file (llama.cpp's format) as a checkpoint: its config, tensor names and data.

A GGUF file carries everything a Hugging Face folder does, under llama.cpp's names:
the architecture's shape as metadata keys (``llama.block_count``...), the tokenizer
(gguf_tokenizer.py), and tensors named ``blk.N.attn_q.weight``, each stored as float
or as one of the block formats of tandem/quant/blocks.py. ``GGUFCheckpoint`` turns the
metadata into a config.json-shaped dict, so the model classes parse it as they parse
any checkpoint, and yields each tensor under its Hugging Face name with its raw rows.

llama.cpp's converter reorders the rows of q and k for the llama architecture (its
rotary pairs dimension i with i + 1, Hugging Face's with i + d/2); ``tensors`` puts
them back, as transformers' GGUF loader does. Whole rows move, so quantized rows are
reordered without decoding them.

The file is read with the ``gguf`` package (the format's reference reader).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.errors import ModelLoadError
from tandem.quant.blocks import BLOCK, FLOAT_TYPES, GGMLType, check_supported

# GGUF architecture name -> the model class name of config.json's "architectures".
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose converter permuted q / k rows for llama.cpp's rotary layout.
PERMUTED_QK = {"llama", "mistral"}

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
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a
    tensor tandem does not use."""
    match = _LAYER_TENSOR.fullmatch(name)
    if match:
        layer, part, kind = match.groups()
        if part not in LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    base, _, kind = name.rpartition(".")
    return f"{GLOBAL_NAMES[base]}.{kind}" if base in GLOBAL_NAMES else None


@dataclass
class GGUFTensor:
    name: str  # the Hugging Face name
    gguf_name: str
    type: GGMLType
    shape: tuple[int, ...]  # torch order: [rows, columns] for a matrix
    data: torch.Tensor  # uint8 [rows, row bytes] for block formats, else float [shape]

    @property
    def quantized(self) -> bool:
        return self.type in BLOCK


def _unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation ([heads, 2, d/2] -> [heads, d/2, 2] order)."""
    rows = t.shape[0]
    half = rows // heads // 2
    return t.reshape(heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ModelLoadError(
                f"reading {self.path.name} needs the gguf package (pip install gguf)"
            ) from None
        try:
            self._reader = GGUFReader(str(self.path))
        except Exception as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc}") from None
        self.architecture = str(self.value("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            supported = ", ".join(ARCHITECTURES)
            raise ModelLoadError(
                f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported "
                f"(supported: {supported})"
            )
        self.tensor_names = {t.name for t in self._reader.tensors}

    def value(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.architecture}.{key}", default)

    def _required(self, key: str) -> Any:
        value = self._arch(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name} has no {self.architecture}.{key}")
        if isinstance(value, list):  # per-layer values: tandem's models use one
            if len(set(value)) != 1:
                raise ModelLoadError(
                    f"{self.path.name}: {self.architecture}.{key} differs between layers "
                    "(not supported)"
                )
            value = value[0]
        return value

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a config.json dict for the model classes' parse_config."""
        if "rope_freqs.weight" in self.tensor_names:
            raise ModelLoadError(
                f"{self.path.name} scales rotary frequencies by a rope_freqs tensor "
                "(Llama 3.1-style rope), which the GGUF loader does not read yet"
            )
        heads = self._required("attention.head_count")
        hidden = self._required("embedding_length")
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._arch("vocab_size") or (len(tokens.data) if tokens is not None else None)
        if vocab is None:
            raise ModelLoadError(f"{self.path.name} states no vocabulary size")
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "hidden_size": hidden,
            "num_hidden_layers": self._required("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": (
                heads
                if self._arch("attention.head_count_kv") is None
                else self._required("attention.head_count_kv")
            ),
            "head_dim": self._arch("attention.key_length") or hidden // heads,
            "intermediate_size": self._required("feed_forward_length"),
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
        return config

    def tensors(self) -> Iterator[GGUFTensor]:
        if self.architecture in PERMUTED_QK:
            config = self.hf_config()
            heads = {
                "attn_q": config["num_attention_heads"],
                "attn_k": config["num_key_value_heads"],
            }
        for tensor in self._reader.tensors:
            name = hf_name(tensor.name)
            if name is None:
                continue
            code = check_supported(int(tensor.tensor_type), tensor.name)
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            data = torch.from_numpy(np.array(tensor.data))  # a copy: the map is read-only
            if code in FLOAT_TYPES:
                data = data.view(FLOAT_TYPES[code]).reshape(shape)
            else:
                data = data.reshape(shape[0] if len(shape) > 1 else 1, -1)
            part = tensor.name.split(".")[-2]
            if self.architecture in PERMUTED_QK and part in ("attn_q", "attn_k"):
                data = _unpermute_rows(data, heads[part])
            yield GGUFTensor(name, tensor.name, code, shape, data)


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or a folder's only .gguf file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise ModelLoadError(f"{path} holds several GGUF files ({names}); pass one of them")
        return files[0] if files else None
    return None
