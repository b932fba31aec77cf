"""A local Hugging Face model folder -> config, weights on the device, tokenizer.

Weights are read tensor by tensor from memory-mapped safetensors files (one file, or
shards listed in ``model.safetensors.index.json``), so a checkpoint is never copied
whole into RAM. Every problem with the folder becomes one ``ModelLoadError`` line that
names the file and, for weights, the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tandem.errors import ModelLoadError
from tandem.models.catalog import resolve_model
from tandem.models.config import ModelConfig, eos_ids
from tandem.models.dtypes import DTYPES
from tandem.models.gguf_checkpoint import find_gguf
from tandem.models.linear import MergedLinear
from tandem.models.quantized import quantize_linear_layers
from tandem.models.registry import model_class_for
from tandem.models.tokenizer import Tokenizer


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

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: config, generation config and tokenizer."""
        ids = list(self.config.eos_token_ids)
        ids += eos_ids(self.generation_config.get("eos_token_id"))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}") from None


def read_config(path: str | Path) -> tuple[dict[str, Any], ModelConfig, type]:
    """The raw config.json of a model folder (or the file itself; or a GGUF file's
    metadata as one), its parsed ModelConfig, and the model class to build."""
    path = Path(resolve_model(path))
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        from tandem.models.gguf_checkpoint import GGUFCheckpoint

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
    raw = _read_json(config_path)
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


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists missing shard(s): {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"{folder} has no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are read)"
    )


def iterate_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    for path in checkpoint_files(folder):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:
            raise ModelLoadError(f"cannot read weights file {path}: {exc}") from None
        with handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name), path


def _expected_parts(model: nn.Module) -> set[tuple[str, int | None]]:
    expected = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, MergedLinear):
                expected.update((full, i) for i in range(len(module.output_sizes)))
            else:
                expected.add((full, None))
    # Tied weights show up under both names; keep the one named_parameters keeps.
    kept = {name for name, _ in model.named_parameters()}
    return {(name, part) for name, part in expected if name in kept}


def load_weights(model: nn.Module, folder: Path) -> None:
    tensors = ((name, tensor, path.name) for name, tensor, path in iterate_checkpoint(folder))
    copy_tensors(model, tensors, str(folder))


def copy_tensors(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor, str]],
    source: str,
    loaded: set[tuple[str, int | None]] | None = None,
) -> None:
    """Copy checkpoint tensors (name, tensor, file) into the model's parameters and
    check that every parameter (every part of a fused one) got one; ``loaded`` names
    the parts already filled another way (quantized weights)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded = set(loaded or ())
    for name, tensor, file in tensors:
        target = model.checkpoint_target(name)
        if target is None:
            continue
        param_name, part = target
        if param_name not in params:
            raise ModelLoadError(f"unexpected tensor {name!r} in {file}")
        param = params[param_name].data
        if part is not None:
            param = param[modules[param_name.rsplit(".", 1)[0]].shard_rows(part)]
        tensor = model.convert_checkpoint_tensor(name, tensor)
        if tensor.shape != param.shape:
            raise ModelLoadError(
                f"tensor {name!r} in {file} has shape {list(tensor.shape)}, "
                f"expected {list(param.shape)}"
            )
        param.copy_(tensor)
        loaded.add((param_name, part))
    missing = sorted(_expected_parts(model) - loaded, key=str)
    if missing:
        shown = ", ".join(n if p is None else f"{n} (part {p})" for n, p in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"checkpoint in {source} is missing tensor(s): {shown}{more}")


QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_k")


def load_model(
    folder: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    quantization: str = "auto",
) -> LoadedModel:
    """A Hugging Face folder or a GGUF file (or a folder holding one) -> LoadedModel.

    ``quantization``: ``auto`` keeps a GGUF file's formats (weights stay quantized on
    a CPU with the compiled kernels) and a float checkpoint float; ``none`` makes every
    weight float in ``dtype``; ``q8_0`` / ``q4_0`` / ``q4_k`` quantize every linear
    layer on load into that llama.cpp format."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization {quantization!r} is not supported (use {', '.join(QUANTIZATIONS)})"
        )
    folder = resolve_model(folder)
    gguf_file = find_gguf(folder)
    if gguf_file is not None:
        from tandem.models.gguf_loader import load_gguf

        return load_gguf(gguf_file, dtype, device, load_tokenizer, quantization)
    folder = Path(folder)
    _, config, cls = read_config(folder)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    # Build without allocating or initialising (meta), then materialise on the device;
    # every parameter is then overwritten from the checkpoint.
    with torch.device("meta"):
        model = cls(config).to(dtype)
    model = model.to_empty(device=device)
    model.tie_weights()  # materialising replaced the shared parameter
    with torch.no_grad():
        load_weights(model, folder)
        if quantization not in ("auto", "none"):
            quantize_linear_layers(model, quantization, device)
    model.eval().requires_grad_(False)
    tokenizer = None
    if load_tokenizer and (folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer(folder)
    generation_path = folder / "generation_config.json"
    generation_config = _read_json(generation_path) if generation_path.is_file() else {}
    return LoadedModel(folder, config, model, tokenizer, dtype, device, generation_config)
