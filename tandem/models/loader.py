"""A model path -> config, weights on the device, tokenizer: where loading starts.

    path -> a GGUF file (gguf_checkpoint.py) or a Hugging Face folder's safetensors
            files (weight_source.py): the config, and the tensors, lazily
         -> the model class built on meta from the config (registry.py)
         -> weight_loading.py: each tensor read, packed or converted, released, in turn
         -> quantized on load if asked (quantized.py), the tokenizer

One direction: nothing below imports this module back. Every problem with the files
becomes one ``ModelLoadError`` line that names the file and, for weights, the tensor.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.kernels import cpu as cpu_kernels
from tandem.models.catalog import resolve_model
from tandem.models.config import ModelConfig, eos_ids
from tandem.models.decoder_classifier import (
    add_score_head,
    attach,
    classifier_of,
    with_name_defaults,
)
from tandem.models.dtypes import DTYPES
from tandem.models.gguf_checkpoint import GGUFCheckpoint, find_gguf
from tandem.models.gguf_tokenizer import build_tokenizer
from tandem.models.quantized import quantize_linear_layers
from tandem.models.registry import model_class_for
from tandem.models.sharding import ShardPlan, is_routed_expert, shard_model
from tandem.models.tokenizer import Tokenizer
from tandem.models.weight_loading import load_weights
from tandem.models.weight_source import SafetensorsCheckpoint, read_json
from tandem.quant import split_blocks
from tandem.quant.blocks import BLOCK

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    folder: Path
    config: ModelConfig
    model: nn.Module
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    device: torch.device
    # generation_config.json as written, for default sampling settings.
    generation_config: dict[str, Any] = field(default_factory=dict)
    # A tensor-parallel rank's plan (``config`` is then the rank's share of the model).
    shard: ShardPlan | None = None
    # How the model's embeddings are read (sentence_transformers_pooling): {} if unsaid.
    pooling_config: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: config, generation config and tokenizer."""
        ids = list(self.config.eos_token_ids)
        ids += eos_ids(self.generation_config.get("eos_token_id"))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))


def read_config(path: str | Path) -> tuple[dict[str, Any], ModelConfig, type]:
    """The raw config.json of a model folder (or the file itself; or a GGUF file's
    metadata as one), its parsed ModelConfig, and the model class to build."""
    path = Path(resolve_model(path))
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        raw = GGUFCheckpoint(gguf_file).hf_config()
        cls = model_class_for(raw)
        return raw, cls.parse_config(raw), cls
    if path.is_file() and path.suffix == ".json":
        config_path = path
    elif not path.is_dir():
        raise ModelLoadError(
            f"model folder {path} does not exist (it is neither a model folder nor a "
            "config.json file)"
        )
    else:
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model folder?")
    raw = read_json(config_path)
    cls = model_class_for(raw)
    return raw, cls.parse_config(raw), cls


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"device {device!r} is not supported (use cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but torch sees no CUDA GPU")
    if device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {device.type!r} is not supported (use cpu or cuda)")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (torch's CPU matmuls are fastest there for decode)
    and bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        runnable = [name for name, entry in DTYPES.items() if entry.torch is not None]
        if dtype not in runnable:
            raise ModelLoadError(f"dtype {dtype!r} is not supported (use {', '.join(runnable)})")
        dtype = DTYPES[dtype].torch
    if device.type == "cpu" and dtype == torch.float16:
        raise ModelLoadError("float16 is not supported on CPU; use bfloat16 or float32")
    return dtype


@contextlib.contextmanager
def initializers_skipped() -> Iterator[None]:
    """Layers' initializers do nothing while a model is built to be loaded: every
    weight is overwritten from the checkpoint, and on meta tensors ``normal_`` imports
    torch's symbolic-shape machinery (sympy), 0.8 s and 75 MB of a process's memory."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_k")


def load_model(
    folder: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    quantization: str = "auto",
    tensor_parallel: tuple[int, int] | None = None,
    expert_parallel: bool = False,
    hf_overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """A Hugging Face folder or a GGUF file (or a folder holding one) -> LoadedModel.

    ``quantization``: ``auto`` keeps a GGUF file's formats, and those of a folder's
    block-format tensors (gpt-oss's MXFP4 experts) (weights stay quantized on
    a CPU with the compiled kernels, and block matrices on a CUDA GPU with Triton,
    split_blocks.kept_in_blocks; any other tensor is dequantized to ``dtype``, as
    transformers' GGUF loader does, which is also the reference the tests compare the
    kernels with) and a float checkpoint float; ``none`` makes every weight float in
    ``dtype``; ``q8_0`` / ``q4_0`` / ``q4_k`` quantize every linear layer on load into
    that llama.cpp format. ``hf_overrides``: merged into config.json (or the GGUF
    file's config) before anything reads it.
    ``tensor_parallel``: (rank, size): the rank's shard of every weight
    (models/sharding.py; ``expert_parallel``: a mixture's experts whole, a run of them
    a rank); the config is then the rank's."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization {quantization!r} is not supported (use {', '.join(QUANTIZATIONS)})"
        )
    path = Path(resolve_model(folder))
    gguf_file = find_gguf(path)
    device = resolve_device(device)
    if gguf_file is not None:
        checkpoint = GGUFCheckpoint(gguf_file)
        raw, source, folder = checkpoint.hf_config(), checkpoint, gguf_file
    else:
        raw, _, _ = read_config(path)
        source, folder = SafetensorsCheckpoint(path), path
    raw = with_name_defaults({**raw, **(hf_overrides or {})}, str(folder))
    cls = model_class_for(raw)
    config = cls.parse_config(raw)
    classifier = classifier_of(raw, config.encoder)
    dtype = resolve_dtype(dtype, device)
    # (a Hugging Face folder's block-format tensors: gpt-oss's MXFP4 experts)
    keep = quantization == "auto" and (
        cpu_kernels.available(device, torch.float32) or split_blocks.runs_on(device)
    )
    with source, torch.no_grad():
        tensors = list(source.tensors())
        # A tensor that holds several parameters' data (gpt-oss's stacked experts) as
        # one tensor per parameter, each reading its own part (the shard plan below
        # cuts them on their own blocks).
        if hasattr(cls, "checkpoint_tensors"):
            tensors = cls.checkpoint_tensors(tensors, config)
        shard = None
        if tensor_parallel is not None:  # (size 1 too: a group of one runs its collectives)
            blocks = [BLOCK[t.type][0] for t in tensors if t.quantized]
            expert_blocks = [
                BLOCK[t.type][0] for t in tensors if t.quantized and is_routed_expert(t.name)
            ]
            shard = ShardPlan(
                config, *tensor_parallel, block=max(blocks, default=1),
                expert_block=max(expert_blocks, default=1), expert_parallel=expert_parallel,
            )  # fmt: skip
            config = shard.config
        # Built without allocating (meta); load_weights materialises what stays float.
        with torch.device("meta"), initializers_skipped():
            model = cls(config)
            if classifier is not None and not classifier.from_tokens:
                add_score_head(model, classifier)
            model = model.to(dtype)
            if shard is not None:
                shard_model(model, shard)
        model = load_weights(model, tensors, str(folder), device, dtype, keep, shard)
        if quantization not in ("auto", "none"):
            quantize_linear_layers(model, quantization, device)
    model.eval().requires_grad_(False)
    if gguf_file is not None and checkpoint.decoded:
        logger.warning(
            "%s: %s decoded to float32 at load (the kernels' layouts do not hold them: "
            "these weights take float memory and run at float speed)",
            Path(gguf_file).name,
            ", ".join(f"{n} {kind} tensors" for kind, n in checkpoint.decoded.items()),
        )
    tokenizer, generation_config = None, {}
    if gguf_file is not None:
        vocab = checkpoint.value("tokenizer.ggml.model")
        if load_tokenizer and vocab not in (None, "no_vocab", "none"):
            tokenizer = Tokenizer.from_parts(*build_tokenizer(checkpoint.value))
    else:
        if load_tokenizer and (path / "tokenizer.json").is_file():
            tokenizer = Tokenizer(path)
        generation_path = path / "generation_config.json"
        if generation_path.is_file():
            generation_config = read_json(generation_path)
    if classifier is not None:
        attach(model, classifier, tokenizer)
    return LoadedModel(
        folder, config, model, tokenizer, dtype, device, generation_config, shard,
        sentence_transformers_pooling(path) if gguf_file is None else {},
    )  # fmt: skip


def sentence_transformers_pooling(folder: Path) -> dict[str, Any]:
    """How a sentence-transformers folder says its embeddings are read: its Pooling
    module's mode and whether a Normalize module follows ({} when it says nothing)."""
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return {}
    modules = read_json(modules_path)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    found: dict[str, Any] = {"normalize": "Normalize" in kinds}
    if "Pooling" in kinds and (folder / kinds["Pooling"] / "config.json").is_file():
        pooling = read_json(folder / kinds["Pooling"] / "config.json")
        for key, mode in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                          ("pooling_mode_cls_token", "cls")):  # fmt: skip
            if pooling.get(key):
                found["pooling"] = mode
                break
    return found
