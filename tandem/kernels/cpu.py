"""tandem's CPU kernels, compiled on first use, and when to use them.

cpu_ops.cpp: everything in a decoder layer that is not a weight matmul: RMSNorm with
the residual add fused in, rotary in place, silu(gate) * up, the KV-cache write, and
paged decode attention that reads each K/V row once, straight from the blocks. Eager
torch spends about 40 small ops per layer on these; the kernels make it 7 calls. Also
the small-batch float linear layer and greedy argmax.

quant_ops.cpp: linear layers on weights kept in llama.cpp's block formats, with
integer dot products (tandem/quant/).

decode_layer.cpp: a whole Llama-family decoder layer for decode tokens, the calls
above made from C++ (runner/fused_decode.py decides when).

The module is built with torch.utils.cpp_extension (gcc and ninja) the first time it
is needed and cached by torch, keyed on the CPU's flags since it is compiled with
``-march=native``. If building fails (no compiler), or TANDEM_CPU_KERNELS=0, ``load``
returns None and every caller falls back to torch ops; the tests check both paths
against each other and against transformers.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# One translation unit, in this order: decode_layer.cpp calls the other two.
SOURCES = [
    Path(__file__).with_name(name) for name in ("cpu_ops.cpp", "quant_ops.cpp", "decode_layer.cpp")
]
FUNCTIONS = [
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "write_kv",
    "decode_attention",
    "small_linear",
    "argmax_rows",
    "quant_linear",
    "quant_rows",
    "llama_decode_layer",
]


def _cpu_tag() -> str:
    """The build uses -march=native, so the cached module is keyed on the CPU's flags
    and the source: a cache carried to another machine is never loaded there."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    sources = b"".join(path.read_bytes() for path in SOURCES)
    return hashlib.sha1(flags.encode() + sources).hexdigest()[:10]


@functools.cache
def load():
    """The compiled module, or None when it cannot (or should not) be built."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        name = f"tandem_cpu_ops_{_cpu_tag()}"
        if not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file():
            print(
                "tandem: compiling the CPU kernels (first use only, about a minute; "
                "TANDEM_CPU_KERNELS=0 skips them)",
                file=sys.stderr,
            )
        return load_inline(
            name=name,
            cpp_sources=[path.read_text() for path in SOURCES],
            functions=FUNCTIONS,
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, no headers: the torch path works
        logger.warning("CPU kernels unavailable, using torch ops: %s", exc)
        return None


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels run on ``device`` in ``dtype`` (CPU, float32 / bfloat16, and
    the module built)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and load() is not None


def enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """``available``, and autograd off: inference. Training keeps the torch ops, which
    have gradients."""
    return not torch.is_grad_enabled() and available(device, dtype)


def usable(x: torch.Tensor) -> bool:
    return enabled(x.device, x.dtype)


def decode_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [S, H, D] (one token per sequence; tokens may be strided), k/v blocks
    [num_blocks, block_size, Hkv, D] -> [S, H, D]. Requires ``load()``."""
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    load().decode_attention(
        out, q, k_blocks, v_blocks, block_tables, context_lens, scale, sliding_window or 0
    )
    return out
