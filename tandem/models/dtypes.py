"""The one table of data types: the names users write, their short names, bytes per
element and torch dtype. The loader, the KV transfer, the planner and the CLI read it;
GGUF block formats come from quant/blocks.py's FORMATS."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.quant.blocks import FORMATS as BLOCK_FORMATS
from tandem.quant.blocks import decoded_at_load, type_name


@dataclass(frozen=True)
class DType:
    short: str  # as `tandem plan` prints it
    bytes: float
    torch: torch.dtype | None  # None: a storage format tandem plans for but does not run


DTYPES: dict[str, DType] = {}
for names, entry in (
    (("float32", "fp32"), DType("fp32", 4, torch.float32)),
    (("bfloat16", "bf16"), DType("bf16", 2, torch.bfloat16)),
    (("float16", "fp16", "half"), DType("fp16", 2, torch.float16)),
    (("fp8",), DType("fp8", 1, None)),
    (("int8",), DType("int8", 1, None)),
):
    for name in names:
        DTYPES[name] = entry
# llama.cpp's block formats: bytes a weight including the block scales (Q8_0: 8.5 bits,
# Q4_0: 4.5, Q4_K: 4.5, Q6_K: 6.5625, Q2_K: 2.625, IQ2_XXS: 2.0625), from the one table
# of formats; and every other type llama.cpp writes (NVFP4: 4.5) at its block's size, as
# gguf-py gives it (tandem decodes those to float32 at load: a GGUF file's plan prices
# what it holds, tensor by tensor).
for _format in BLOCK_FORMATS.values():
    _name = _format.name.lower()
    DTYPES[_name] = DType(_name, _format.bytes_per_weight, None)
for _code, (_weights, _nbytes) in sorted(decoded_at_load().items()):
    _name = type_name(_code).lower()
    DTYPES[_name] = DType(_name, _nbytes / _weights, None)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The long name of a torch dtype ("float32"), as in checkpoints and headers."""
    return str(dtype).removeprefix("torch.")
