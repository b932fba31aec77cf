"""A Llama-family tandem model -> a Hugging Face folder (config.json,
model.safetensors, generation_config.json): the inverse of the loader. Fused q/k/v
and gate/up are split back into the checkpoint's tensors; tied weights are stored once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.models.linear import MergedLinear
from tandem.models.llama import LlamaForCausalLM


def checkpoint_tensors(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor, as ``load_weights`` reads them back."""
    modules = dict(model.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():  # tied parameters appear once
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        parent, _, fused_name = module_name.rpartition(".")
        parts = {
            i: part for part, (fused, i) in model.packed_modules.items() if fused == fused_name
        }
        if isinstance(module, MergedLinear) and parts:
            for index, part in sorted(parts.items()):
                tensors[f"{parent}.{part}.{leaf}"] = param.detach()[module.shard_rows(index)]
        else:
            tensors[name] = param.detach()
    return {name: tensor.contiguous().cpu() for name, tensor in tensors.items()}


def save_pretrained(
    model: LlamaForCausalLM,
    raw_config: dict[str, Any],
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"saving {type(model).__name__} is not supported (Llama family only)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(dtype) for name, t in checkpoint_tensors(model).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {**raw_config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if generation_config is not None:
        text = json.dumps(generation_config, indent=2) + "\n"
        (folder / "generation_config.json").write_text(text)
    return folder
