"""The one table of data types: the names users write, their short names, bytes per
element and torch dtype. The loader, the KV transfer, the planner and the CLI read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    # llama.cpp's block formats, bytes per weight including the block scales: Q8_0 is
    # 32 int8 + an fp16 scale (8.5 bits), Q4_0 32 nibbles + a scale (4.5), Q4_1 adds an
    # fp16 minimum (5), Q4_K 4.5 and Q6_K 6.5625 bits in their 256-weight super-blocks.
    (("q8_0",), DType("q8_0", 8.5 / 8, None)),
    (("q4_0",), DType("q4_0", 4.5 / 8, None)),
    (("q4_1",), DType("q4_1", 5 / 8, None)),
    (("q4_k",), DType("q4_k", 4.5 / 8, None)),
    (("q6_k",), DType("q6_k", 6.5625 / 8, None)),
):
    for name in names:
        DTYPES[name] = entry


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The long name of a torch dtype ("float32"), as in checkpoints and headers."""
    return str(dtype).removeprefix("torch.")
