"""Load a GGUF file into a tandem model: weights kept in their block formats.

    file -> GGUFCheckpoint (config, tensors under Hugging Face names, q/k rows restored)
         -> model built on meta from the config
         -> each Linear whose parts are all block-quantized: PackedWeight parts, float
            weight never allocated; the embedding: QuantizedEmbedding (the tied LM head
            shares its PackedWeight); a float32 model's F16 / BF16 matrices: kept at
            2 bytes (``half_weight``)
         -> everything else (norms, biases, float-typed matrices) dequantized to
            ``dtype`` and copied as from safetensors

Weights stay quantized only where they can be multiplied quantized: on the CPU, with
the compiled kernels. Otherwise (a GPU, no compiler, or ``quantization="none"``) every
tensor is dequantized to ``dtype``, exactly as transformers' GGUF loader does; that
path is also the reference the tests compare the quantized kernels with.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from tandem.kernels import cpu as cpu_kernels
from tandem.models.gguf_checkpoint import GGUFCheckpoint, GGUFTensor
from tandem.models.gguf_tokenizer import build_tokenizer
from tandem.models.linear import Linear, MergedLinear
from tandem.models.loader import LoadedModel, copy_tensors, resolve_device, resolve_dtype
from tandem.models.quantized import (
    QuantizedEmbedding,
    drop_float_weight,
    quantize_linear_layers,
    replace_module,
    set_half_weight_part,
    set_packed_part,
)
from tandem.models.registry import model_class_for
from tandem.models.tokenizer import Tokenizer
from tandem.quant.blocks import GGMLType, dequantize
from tandem.quant.packed import PackedWeight


def _float(t: GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    columns = t.shape[-1]
    return dequantize(t.type, t.data, columns).reshape(t.shape).to(dtype)


def load_gguf(
    path: Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    load_tokenizer: bool,
    quantization: str,
) -> LoadedModel:
    checkpoint = GGUFCheckpoint(path)
    raw = checkpoint.hf_config()
    cls = model_class_for(raw)
    config = cls.parse_config(raw)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    keep = quantization == "auto" and cpu_kernels.available(device, torch.float32)
    with torch.device("meta"):
        model = cls(config).to(dtype)
    modules = dict(model.named_modules())

    # Group the file's tensors by the parameter they fill.
    by_param: dict[str, list[tuple[int | None, GGUFTensor]]] = defaultdict(list)
    for tensor in checkpoint.tensors():
        target = model.checkpoint_target(tensor.name)
        if target is not None:
            by_param[target[0]].append((target[1], tensor))

    floats: list[tuple[str, torch.Tensor, str]] = []
    loaded: set[tuple[str, int | None]] = set()
    embedding_packed = None
    for param_name, parts in by_param.items():
        module_name, _, kind = param_name.rpartition(".")
        module = modules.get(module_name)
        quantizable = isinstance(module, (Linear, nn.Embedding)) and kind == "weight"
        types = {t.type for _, t in parts}
        # One float16 or bfloat16 type for all parts: kept at 2 bytes (no conversion).
        half = len(types) == 1 and types <= {GGMLType.F16, GGMLType.BF16}
        if (
            keep
            and half
            and isinstance(module, Linear)
            and kind == "weight"
            and dtype == torch.float32
        ):
            # F16 / BF16 matrices stay 2 bytes a weight (runner/linear/half_weights.py)
            for part, tensor in parts:
                start = module.shard_rows(part).start if isinstance(module, MergedLinear) else 0
                set_half_weight_part(module, start, tensor.data)
                loaded.add((param_name, part))
            drop_float_weight(module)
            continue
        if not (keep and quantizable and all(t.quantized for _, t in parts)):
            floats += [(t.name, _float(t, dtype), path.name) for _, t in parts]
            continue
        for part, tensor in parts:
            packed = PackedWeight.from_ggml(tensor.type, tensor.data, tensor.shape[1])
            if isinstance(module, nn.Embedding):
                embedding_packed = packed
                replace_module(model, module_name, QuantizedEmbedding(packed, dtype))
            else:
                start = module.shard_rows(part).start if isinstance(module, MergedLinear) else 0
                set_packed_part(module, start, packed)
            loaded.add((param_name, part))
        if isinstance(module, Linear):
            drop_float_weight(module)
    if embedding_packed is not None and config.tie_word_embeddings:
        head = model.get_submodule("lm_head")
        set_packed_part(head, 0, embedding_packed)
        drop_float_weight(head)
        loaded.add(("lm_head.weight", None))

    model = model.to_empty(device=device)
    if embedding_packed is None:
        model.tie_weights()  # materialising replaced the shared parameter
    with torch.no_grad():
        copy_tensors(model, floats, str(path), loaded)
        if quantization not in ("auto", "none"):
            quantize_linear_layers(model, quantization, device)
    model.eval().requires_grad_(False)
    tokenizer = None
    if load_tokenizer and checkpoint.value("tokenizer.ggml.model") not in (
        None,
        "no_vocab",
        "none",
    ):
        tokenizer = Tokenizer.from_parts(*build_tokenizer(checkpoint.value))
    return LoadedModel(path, config, model, tokenizer, dtype, device, {})
