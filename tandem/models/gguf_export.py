"""Write a Hugging Face checkpoint as a GGUF file llama.cpp loads (``tandem quantize``).

The inverse of gguf_checkpoint.py: config.json -> llama.cpp's metadata keys, tensor
names -> ``blk.N.*``, q/k rows permuted into llama.cpp's rotary order (llama and
mistral), the byte-level BPE tokenizer.json -> ``tokenizer.ggml.*`` (type gpt2), and
each matrix encoded in the chosen format by tandem/quant/quantize.py (float formats
by a cast). As llama.cpp does, 1-D tensors (norms, biases) stay float32, and a matrix
whose rows are not whole blocks of the format is written in llama-quantize's fallback
type for it (Q4_0 for Q2_K and Q3_K, IQ4_NL for IQ4_XS, Q5_0 for Q4_K: blocks of 32),
else as float16.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tandem.errors import ModelLoadError
from tandem.models.config import ModelConfig
from tandem.models.family import Family
from tandem.models.gguf_checkpoint import EXPERT_NAMES, global_names, layer_names
from tandem.models.loader import read_config
from tandem.models.mixtral import MIXTRAL, hf_expert_name
from tandem.models.registry import FAMILIES, family_for
from tandem.models.weight_source import SafetensorsCheckpoint
from tandem.quant.blocks import GGMLType, dequantize_other
from tandem.quant.quantize import FORMATS, QUANTIZERS, quantize

EXPORT_TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16}
EXPORT_TYPES.update(FORMATS)

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.(weight|bias)")
_STACKED = {hf: gguf for gguf, hf in EXPERT_NAMES.items()}


def expert_of(name: str) -> tuple[str, int] | None:
    """``model.layers.3.mlp.experts.5.up_proj.weight`` -> (``blk.3.ffn_up_exps.weight``,
    5): the stacked tensor it goes into and its place there (biases alike)."""
    match = _EXPERT.fullmatch(name)
    if match is None or match.group(3) not in _STACKED:
        return None
    layer, expert, projection, kind = match.groups()
    return f"blk.{layer}.{_STACKED[projection]}.{kind}", int(expert)


def gguf_name(name: str, family: Family | None = None) -> str | None:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``."""
    if name.startswith("model.layers."):
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        for gguf, hf in layer_names(family).items():
            if rest == hf:  # (a tensor with no .weight: Gated DeltaNet's ssm_a)
                return f"blk.{layer}.{gguf}"
            hf, gguf = f"{hf}.", f"{gguf}."
            if rest.startswith(hf):
                return f"blk.{layer}.{gguf}{rest.removeprefix(hf)}"
        return None
    for gguf, hf in global_names(family).items():
        if name.startswith(f"{hf}."):
            return gguf + name.removeprefix(hf)
    return None


def _permute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's q/k row order -> llama.cpp's (inverse of _unpermute_rows)."""
    half = t.shape[0] // heads // 2
    return t.reshape(heads, 2, half, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


# llama-quantize's type for rows that are not whole super-blocks (llama-quant.cpp's
# tensor_type_fallback).
_FALLBACK = {GGMLType.Q2_K: GGMLType.Q4_0, GGMLType.Q3_K: GGMLType.Q4_0,
             GGMLType.IQ4_XS: GGMLType.IQ4_NL, GGMLType.Q4_K: GGMLType.Q5_0}  # fmt: skip


def _block_weights(code: GGMLType) -> int:
    import gguf

    if code in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        return 1
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(code))][0]


def _file_type(code: GGMLType) -> int:
    import gguf

    names = {
        GGMLType.F32: "ALL_F32",
        GGMLType.F16: "MOSTLY_F16",
        GGMLType.BF16: "MOSTLY_BF16",
        GGMLType.Q8_0: "MOSTLY_Q8_0",
        GGMLType.Q4_0: "MOSTLY_Q4_0",
        GGMLType.Q4_K: "MOSTLY_Q4_K_S",
        GGMLType.Q3_K: "MOSTLY_Q3_K_S",
        GGMLType.Q2_K: "MOSTLY_Q2_K",
        GGMLType.IQ4_NL: "MOSTLY_IQ4_NL",
        GGMLType.IQ4_XS: "MOSTLY_IQ4_XS",
        GGMLType.MXFP4: "MOSTLY_MXFP4_MOE",
        GGMLType.Q5_0: "MOSTLY_Q5_0",
    }
    return int(gguf.LlamaFileType[names[code]])


def _add_tokenizer(writer, folder: Path, raw: dict) -> None:
    path = folder / "tokenizer.json"
    if not path.is_file():
        writer.add_tokenizer_model("no_vocab")  # llama.cpp's name for a model without one
        return
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ModelLoadError(
            f"{path}: only byte-level BPE tokenizers are exported (this one is "
            f"{model.get('type')!r})"
        )
    vocab = dict(model["vocab"])
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    for index, token in added.items():
        vocab.setdefault(token["content"], index)
    size = max(raw["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # UNUSED, for ids the vocabulary leaves empty
    for token, index in vocab.items():
        tokens[index] = token
        types[index] = 1  # NORMAL
    for index, token in added.items():
        types[index] = 3 if token.get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}

    def token_id(key: str) -> int | None:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return vocab.get(value) if value is not None else None

    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
    ):
        index = token_id(key)
        if index is not None:
            add(index)
    post = json.dumps(spec.get("post_processor"))
    writer.add_add_bos_token(bool(config.get("add_bos_token")) or '"<s>"' in post)
    template = config.get("chat_template")
    jinja = folder / "chat_template.jinja"  # (where transformers 5 saves it)
    if not isinstance(template, str) and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str):
        writer.add_chat_template(template)


def add_shape_keys(writer, config: ModelConfig, family: Family) -> None:
    """The architecture's shape as llama.cpp's metadata keys."""
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    if family.gguf_kv_heads_per_layer:  # (0: a layer without attention)
        kv = set(config.kv_layers)
        writer.add_head_count_kv(
            [config.num_kv_heads * (i in kv) for i in range(config.num_layers)]
        )
    elif config.layer_kv_shapes:  # (layers whose KV heads differ: Gemma 4's full ones)
        writer.add_head_count_kv([config.kv_shape(i)[0] for i in range(config.num_layers)])
    else:
        writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.moe is not None:
        writer.add_expert_count(config.moe.num_experts)
        writer.add_expert_used_count(config.moe.top_k)
        writer.add_expert_feed_forward_length(config.moe.intermediate_size)
        if config.moe.shared_intermediate_size:
            writer.add_expert_shared_feed_forward_length(config.moe.shared_intermediate_size)
    if config.rope is not None:
        writer.add_rope_freq_base(config.rope.theta)
        writer.add_rope_dimension_count(config.rope.rotary_dim)
        if config.rope.scaling_type == "yarn":  # as llama.cpp's converter writes it
            import gguf

            scaling = config.rope.scaling
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(scaling["factor"])
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            for key, add in (
                ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
            ):
                if scaling.get(key) is not None:
                    add(scaling[key])
        elif config.rope.scaling_type not in ("default", "proportional"):
            # (proportional: the family writes which pairs turn, Gemma 4's rope_freqs)
            raise ModelLoadError(f"rope scaling {config.rope.scaling_type!r} is not exported")


def _check_moe(config, family: Family) -> None:
    """llama.cpp's graphs make every layer of a mixture sparse (or the first few dense:
    Family.gguf_leading_dense), and renormalize the picked experts' weights and have a
    shared expert as the family says (Family.gguf_renormalizes_experts,
    gguf_shared_expert: only Qwen2-MoE differs). A model that differs cannot be written
    faithfully."""
    moe = config.moe
    if moe is None:
        return
    shared = bool(moe.shared_intermediate_size)
    renormalizes = family.gguf_renormalizes_experts
    leading = family.gguf_leading_dense and moe.dense_layers == tuple(range(len(moe.dense_layers)))
    if (
        (moe.dense_layers and not leading)
        or moe.normalize_top_k != renormalizes
        or (shared != family.gguf_shared_expert)
    ):
        raise ModelLoadError(
            "this mixture of experts differs from what llama.cpp assumes (every layer "
            "sparse; the picked experts' weights renormalized, except for Qwen2-MoE; a "
            "shared expert only for Qwen2-MoE): it cannot be exported faithfully"
        )


Encoder = Callable[[str, torch.Tensor], "tuple[GGMLType, np.ndarray] | None"]


def export_gguf(
    folder: str | Path,
    out: str | Path,
    fmt: str,
    encoder: Encoder | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """Write the Hugging Face folder as a GGUF file in ``fmt`` (f32, f16, bf16, or a
    block format of quantize.py's: q8_0, q4_0, q4_k, q3_k, q2_k, iq4_nl, iq4_xs,
    mxfp4, q5_0); returns the file written. ``encoder(gguf_name, float_tensor)`` may
    choose another format for any matrix: (type, raw block bytes), or None to leave
    it to ``fmt`` (how mixed files, such as llama.cpp's Q4_K_M, are made).
    ``split_max_tensors``: write parts of at most that many tensors, as llama.cpp's
    gguf-split does (``OUT-00001-of-0000N.gguf`` ...; the first part is returned)."""
    import gguf

    if fmt not in EXPORT_TYPES:
        raise ModelLoadError(f"format {fmt!r} is not supported (use {', '.join(EXPORT_TYPES)})")
    code = EXPORT_TYPES[fmt]
    folder, out = Path(folder), Path(out)
    raw, config, _ = read_config(folder)
    family = family_for(raw)
    arch = family.exported_as
    if arch is None:
        writable = ", ".join(name for f in FAMILIES if f.exported_as for name in f.architectures)
        raise ModelLoadError(
            f"cannot export {raw['architectures']} to GGUF (supported: {writable})"
        )
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    writer.add_name(folder.name)
    writer.add_file_type(_file_type(code))
    add_shape_keys(writer, config, family)
    if family.gguf_write_keys is not None:
        family.gguf_write_keys(writer, config)
    _check_moe(config, family)
    _add_tokenizer(writer, folder, raw)
    if family.gguf_extra_tensors is not None:  # (Gemma 4's rope_freqs)
        for name, values in family.gguf_extra_tensors(config).items():
            writer.add_tensor(name, values)

    # A mixture's experts are stacked per layer and projection, as llama.cpp keeps
    # them: each stack is written once its last expert is read.
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    with SafetensorsCheckpoint(folder) as checkpoint:
        tensors = list(checkpoint.tensors())
        if hasattr(family.model_class, "checkpoint_tensors"):  # (gpt-oss's stacked experts)
            tensors = family.model_class.checkpoint_tensors(tensors, config)
        for tensor in tensors:
            name, values = tensor.name, None
            if family.gguf_write_tensor is not None:
                name, values = family.gguf_write_tensor(name, _float(tensor), config)
                if name is None:
                    continue
            if family is MIXTRAL:
                name = hf_expert_name(name)
            expert = expert_of(name)
            if expert is not None and config.moe is not None:
                target, index = expert
                stack = stacks.setdefault(target, {})
                stack[index] = _float(tensor) if values is None else values
                if len(stack) == config.moe.num_experts:
                    whole = torch.stack([stack[i] for i in range(len(stack))])
                    _add_tensor(writer, target, whole, family, config, code, encoder)
                    del stacks[target]
                continue
            target = gguf_name(name, family)
            if target is not None:
                values = _float(tensor) if values is None else values
                _add_tensor(writer, target, values, family, config, code, encoder)
    if stacks:
        raise ModelLoadError(f"{folder}: experts missing from {', '.join(sorted(stacks))}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = sorted(out.parent.glob(f"{out.stem}-00001-of-*{out.suffix}"))
    return parts[0] if split_max_tensors and parts else out


def _float(tensor) -> torch.Tensor:
    """A checkpoint tensor's values in float32 (a block format's decoded: gpt-oss's
    MXFP4 experts in a Hugging Face folder)."""
    if tensor.quantized:
        return dequantize_other(int(tensor.type), tensor.read().numpy(), tensor.shape)
    return tensor.read().float()


def _add_tensor(writer, target: str, t: torch.Tensor, family: Family, config, code: GGMLType,
                encoder: Encoder | None) -> None:  # fmt: skip
    """One matrix or vector, in llama.cpp's layout and the chosen format."""
    import gguf

    part = target.split(".")[-2]
    if family.gguf_norm_plus_one and target.endswith("norm.weight"):
        t = t if part in family.gguf_plain_norms else t + 1
    if family.gguf_permuted_qk and (".attn_q." in target or ".attn_k." in target):
        heads = config.num_kv_heads if ".attn_k." in target else config.num_heads
        t = _permute_rows(t, heads)
    if ".ffn_gate_inp_shexp." in target:  # the shared expert's gate: a vector, as llama.cpp's
        t = t.reshape(-1)
    kind = code
    # (a router, conv taps, norms, and what is not a .weight: biases, stacked experts'
    # too, Mamba-2's A and D, stay float32, as llama-quantize keeps them)
    if (
        t.dim() == 1
        or not target.endswith(".weight")
        or "_norm.weight" in target
        or any(part in target for part in (".ffn_gate_inp.", ".ssm_conv1d.", ".shortconv.conv."))
    ):
        kind = GGMLType.F32
    elif code in QUANTIZERS and t.shape[-1] % _block_weights(code):
        kind = _FALLBACK.get(code, GGMLType.F16)
        if t.shape[-1] % _block_weights(kind):
            kind = GGMLType.F16
    chosen = encoder(target, t) if encoder is not None and t.dim() == 2 else None
    if chosen is not None:
        kind, data = chosen
        writer.add_tensor(target, data, raw_dtype=gguf.GGMLQuantizationType(int(kind)))
    elif kind in QUANTIZERS:  # (stacked experts: blocks of the rows of every expert)
        data = quantize(t.reshape(-1, t.shape[-1]), kind).numpy()
        data = data.reshape(*t.shape[:-1], data.shape[-1])
        writer.add_tensor(target, data, raw_dtype=gguf.GGMLQuantizationType(int(kind)))
    elif kind == GGMLType.BF16:
        data = t.to(torch.bfloat16).view(torch.uint16).numpy()
        writer.add_tensor(target, data, raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        dtype = np.float16 if kind == GGMLType.F16 else np.float32
        writer.add_tensor(target, t.numpy().astype(dtype))
