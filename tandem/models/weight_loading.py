"""Checkpoint tensors -> a model's parameters, one tensor at a time.

    plan      from the tensors' names, shapes and types alone (nothing read yet), each
              parameter gets a weight loader:
                packed  every part block-quantized and kept so (a CPU with the compiled
                        kernels): PackedWeight parts (models/quantized.py), the float
                        weight never allocated; the embedding as QuantizedEmbedding, a
                        tied LM head sharing its PackedWeight
                split   on a CUDA GPU, Linear matrices whose every part is in a block
                        format (split_blocks.kept_in_blocks): the blocks' fields apart
                        (quant/split_blocks.py), on the device as ``block_parts``
                half    float16 / bfloat16 matrices of a float32 model, kept at 2 bytes
                float   everything else: converted to the model's dtype, a GGUF tensor
                        dequantized through float32 1,024 rows at a time
    allocate  the model moves from meta to the device: only float parameters take memory
    stream    each tensor, in file order, is read (a view of the mapped file), packed
              or copied by its parameter's loader, and its pages released
    check     every parameter (every part of a fused one) got its tensor

So the process holds the model as it will run plus one tensor of the file, never the
file beside it. A tensor-parallel rank narrows each tensor to its slice first
(models/sharding.py): it reads and holds only its share.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from tandem.errors import ModelLoadError
from tandem.models.linear import Linear, MergedLinear
from tandem.models.quantized import (
    QuantizedEmbedding,
    drop_float_weight,
    replace_module,
    set_half_weight_part,
    set_packed_part,
)
from tandem.models.sharding import ShardPlan
from tandem.models.weight_source import CheckpointTensor
from tandem.quant import split_blocks
from tandem.quant.blocks import GGMLType, dequantize
from tandem.quant.packed import ROWS, PackedWeight

PACKED, HALF, FLOAT, SPLIT = "packed", "half", "float", "split"
Part = tuple[int | None, CheckpointTensor]


def _layout(
    module: nn.Module | None,
    kind: str,
    parts: list[Part],
    keep: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> str:
    if not keep or kind != "weight":
        return FLOAT
    if device.type == "cuda":  # block matrices as split blocks; the rest widened
        split = isinstance(module, Linear) and all(
            split_blocks.kept_in_blocks(t.type, t.shape[-1]) for _, t in parts
        )
        return SPLIT if split else FLOAT
    types = {t.type for _, t in parts}
    one_half_type = len(types) == 1 and types <= {GGMLType.F16, GGMLType.BF16}
    if isinstance(module, Linear) and dtype == torch.float32 and one_half_type:
        return HALF
    if isinstance(module, (Linear, nn.Embedding)) and all(t.quantized for _, t in parts):
        return PACKED
    return FLOAT


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


def load_weights(
    model: nn.Module,
    tensors: Iterable[CheckpointTensor],
    source: str,
    device: torch.device,
    dtype: torch.dtype,
    keep_quantized: bool,
    shard: ShardPlan | None = None,
) -> nn.Module:
    """Fill ``model`` (built on meta, in ``dtype``) from ``tensors`` and return it on
    ``device``. ``keep_quantized``: block-quantized matrices stay in their formats
    (the caller checked that the compiled kernels run here). ``shard``: a
    tensor-parallel rank's plan; each tensor is narrowed to the rank's slice before it
    is read (the model was built from ``shard.config`` and cut by ``shard_model``)."""
    tensors = list(tensors)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))

    # (tensor, parameter, part) in file order, for the tensors the model uses.
    targeted: list[tuple[CheckpointTensor, str, int | None]] = []
    by_param: dict[str, list[Part]] = defaultdict(list)
    for tensor in tensors:
        target = model.checkpoint_target(tensor.name)
        if target is None or (shard is not None and not shard.holds(target[0])):
            continue  # (another rank's expert: never read here)
        if target[0] not in params:
            raise ModelLoadError(f"unexpected tensor {tensor.name!r} in {tensor.file}")
        if shard is not None:
            transposed = getattr(model, "stores_transposed", lambda _: False)(tensor.name)
            tensor = shard.narrow(*target, tensor, transposed)
        targeted.append((tensor, *target))
        by_param[target[0]].append((target[1], tensor))

    layouts: dict[str, str] = {}
    joints: dict[str, _Joint] = {}
    loaded: set[tuple[str, int | None]] = set()
    tied_head = None
    # The embedding the LM head is (Gemma 4 has another, its per-layer inputs'): the one
    # whose weight it holds, or (a tensor-parallel rank's head, cut apart from it) the
    # model's first embedding.
    head_weight = getattr(modules.get("lm_head"), "weight", None) if tied else None
    embeddings = [name for name, m in modules.items() if isinstance(m, nn.Embedding)]
    tied_name = next(
        (name for name in embeddings if modules[name].weight is head_weight),
        embeddings[0] if tied and embeddings else None,
    )
    for param_name, parts in by_param.items():
        module_name, _, kind = param_name.rpartition(".")
        module = modules.get(module_name)
        layout = layouts[param_name] = _layout(module, kind, parts, keep_quantized, dtype, device)
        if layout == FLOAT:
            continue
        if layout == PACKED and _joinable(module, parts):
            joints[param_name] = _Joint(module, parts)
        drop_float_weight(module)  # on meta: the float weight is never allocated
        if module_name == tied_name:
            tied_head = modules["lm_head"]
            drop_float_weight(tied_head)
            loaded.add(("lm_head.weight", None))

    materialize(model, device)
    if tied_head is None:
        model.tie_weights()  # the model's own statement of its tie (materialize kept it)
    params = dict(model.named_parameters())
    for tensor, param_name, part in targeted:
        module_name = param_name.rpartition(".")[0]
        layout = layouts[param_name]
        if param_name in joints:
            joints[param_name].fill(part, tensor)
        elif layout == PACKED:
            head = tied_head if module_name == tied_name else None
            _load_packed(model, modules[module_name], module_name, part, tensor, dtype, head)
        elif layout == SPLIT:
            module = modules[module_name]
            weight = split_blocks.from_ggml(tensor.type, tensor.read(), tensor.shape[-1], device)
            split_blocks.add_block_part(module, _row_start(module, part), weight)
        elif layout == HALF:
            module = modules[module_name]
            set_half_weight_part(module, _row_start(module, part), tensor.read())
        else:
            _load_float(model, params[param_name], modules, param_name, part, tensor, dtype)
        tensor.release()
        loaded.add((param_name, part))

    missing = sorted(_expected_parts(model) - loaded, key=str)
    if missing:
        shown = ", ".join(n if p is None else f"{n} (part {p})" for n, p in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"checkpoint in {source} is missing tensor(s): {shown}{more}")
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)`` without its cost: to_empty makes each tensor with
    ``empty_like`` of a meta tensor, whose Python meta kernel imports torch's
    symbolic-shape machinery (sympy: most of a second and 75 MB on first use). Shared
    tensors stay shared."""
    made: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            empty = torch.empty(tuple(t.shape), dtype=t.dtype, device=device)
            is_param = isinstance(t, nn.Parameter)
            made[id(t)] = nn.Parameter(empty, t.requires_grad) if is_param else empty
        return made[id(t)]

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is not None:
                    tensors[name] = fresh(t)


def _joinable(module: nn.Module | None, parts: list[Part]) -> bool:
    """The parts of a fused layer (q/k/v, gate/up) in one format, each starting on a
    whole tile: packed straight into one matrix (no copy to join them later)."""
    return (
        isinstance(module, MergedLinear)
        and len(parts) == len(module.output_sizes) > 1
        and len({t.type for _, t in parts}) == 1
        and all(module.shard_rows(part).start % ROWS == 0 for part, _ in parts)
    )


class _Joint:
    """One PackedWeight for all parts of a fused layer, handed to the layer once the
    last part is in."""

    def __init__(self, module: MergedLinear, parts: list[Part]) -> None:
        self.module = module
        self.waiting = len(parts)
        self.weight = PackedWeight.allocate(
            parts[0][1].type, module.out_features, module.in_features
        )

    def fill(self, part: int | None, tensor: CheckpointTensor) -> None:
        _pack_rows(self.weight, self.module.shard_rows(part).start, tensor)
        self.waiting -= 1
        if self.waiting == 0:
            set_packed_part(self.module, 0, self.weight)


# Rows packed before their file pages are released (whole tiles): the file is let go
# of a few MB at a time, so the process never holds one whole tensor of it beside the
# packed model (a 128k-token output matrix is 0.4 GB).
SLICE_ROWS = 1024


def _pack_rows(weight: PackedWeight, row_start: int, tensor: CheckpointTensor) -> None:
    raw = tensor.read()
    for first in range(0, raw.shape[0], SLICE_ROWS):
        rows = slice(first, min(first + SLICE_ROWS, raw.shape[0]))
        weight.fill_rows(row_start + first, tensor.type, raw[rows])
        tensor.release(rows)


def _row_start(module: nn.Module, part: int | None) -> int:
    return module.shard_rows(part).start if isinstance(module, MergedLinear) else 0


def _load_packed(
    model: nn.Module,
    module: nn.Module,
    module_name: str,
    part: int | None,
    tensor: CheckpointTensor,
    dtype: torch.dtype,
    tied_head: nn.Module | None,
) -> None:
    packed = PackedWeight.allocate(tensor.type, tensor.shape[0], tensor.shape[1])
    _pack_rows(packed, 0, tensor)
    if isinstance(module, nn.Embedding):
        replace_module(model, module_name, QuantizedEmbedding(packed, dtype))
        if tied_head is not None:
            set_packed_part(tied_head, 0, packed)
    else:
        set_packed_part(module, _row_start(module, part), packed)


def _load_float(
    model: nn.Module,
    param: torch.Tensor,
    modules: dict[str, nn.Module],
    param_name: str,
    part: int | None,
    tensor: CheckpointTensor,
    dtype: torch.dtype,
) -> None:
    target = param.data
    if part is not None:
        target = target[modules[param_name.rsplit(".", 1)[0]].shard_rows(part)]
    data = tensor.read()
    if tensor.type is None:  # safetensors: in the class's layout (GPT-2's Conv1D...)
        data = model.convert_checkpoint_tensor(tensor.name, data)
    shape = tuple(tensor.shape) if tensor.type is not None else tuple(data.shape)
    if shape != tuple(target.shape):
        raise ModelLoadError(
            f"tensor {tensor.name!r} in {tensor.file} has shape {list(shape)}, "
            f"expected {list(target.shape)}"
        )
    with torch.no_grad():
        if tensor.type is None:
            target.copy_(data)
            return
        # GGUF tensors come in Hugging Face's layout (gguf_checkpoint.py): dequantized
        # to float32 (as transformers' GGUF loader) a slice of rows at a time, so a
        # 128k-token embedding never exists whole in float32 beside the model.
        columns = tensor.shape[-1]
        rows = data.reshape(-1, data.shape[-1])
        flat = target.view(-1, columns)
        for first in range(0, flat.shape[0], SLICE_ROWS):
            last = min(first + SLICE_ROWS, flat.shape[0])
            flat[first:last].copy_(dequantize(tensor.type, rows[first:last], columns))
