"""Compile every Triton kernel of the GPU path for an H100 (sm_90), on any machine.

Triton's interpreter (tests/test_gpu_kernels_interpreted.py) runs the kernels' math on
the CPU but never compiles them: a construct the interpreter accepts and the compiler
refuses (a global that is not a constexpr, a type the hardware lacks) would first
show on a GPU, where time is short. Triton's wheel carries its NVIDIA backend and
ptxas, so each kernel is compiled here to a cubin for the target, in the variants
the engine launches (every GGUF block format, every KV cache type, split and whole).

    python tests/gpu_kernel_builds.py            # prints each kernel and its cubin size
    python tests/gpu_kernel_builds.py --usage    # and its registers and spills a thread

Run as a script: tandem defines its kernels only where Triton can run
(kernels/triton_support.py), so this process says it has a CUDA device before
importing them; nothing is launched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import torch

torch.cuda.is_available = lambda: True  # define the kernels as on a GPU machine

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tandem.kernels import cuda as cuda_kernels  # noqa: E402
from tandem.quant.blocks import FORMATS  # noqa: E402
from tandem.quant.split_blocks import SUPER_FORMATS  # noqa: E402
from tandem.runner.attention import triton_paged  # noqa: E402
from tandem.runner.linear import triton_blocks  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
USAGE = "--usage" in sys.argv


def build(kernel, types: dict[str, str], constants: dict[str, object]) -> int:
    """Compile ``kernel`` with its run-time arguments of ``types`` and its constexprs
    ``constants`` -> the cubin's bytes. Every argument must be given one or the other."""
    signature = {}
    for name in kernel.arg_names:
        signature[name] = "constexpr" if name in constants else types[name]
    started = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=TARGET)
    size = len(compiled.asm["cubin"])
    shown = ", ".join(f"{k}={v}" for k, v in constants.items())
    usage = f"; {resources(compiled.asm['cubin'])}" if USAGE else ""
    print(f"{kernel.__name__}({shown}): {size} bytes, {time.perf_counter() - started:.1f} s{usage}")
    return size


def resources(cubin: bytes) -> str:
    """Registers and stack (spills) a thread, from the cuobjdump Triton carries."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [tool, "--dump-resource-usage", file.name], capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", report, re.S)
    return f"{found.group(1)} registers, {found.group(2)} bytes of stack" if found else report


def block_kernels() -> None:
    ints = dict.fromkeys(
        ("M", "N", "K", "stride_xm", "stride_om", "stride_vn", "stride_sn", "stride_os",
         "splits", "stride_on"),
        "i32",
    )  # fmt: skip
    pointers = {"out_ptr": "*bf16", "x_ptr": "*bf16", "scales_ptr": "*fp16"}
    for bits, values in ((4, "*u8"), (8, "*i8")):
        types = {**ints, **pointers, "values_ptr": values}
        tile = dict(BLOCK_N=32, BLOCK_K=256)
        build(triton_blocks._block_product, types, dict(BITS=bits, DOT=True, BLOCK_M=16, **tile))
        build(triton_blocks._block_product, types, dict(BITS=bits, DOT=False, BLOCK_M=1, **tile))
        build(triton_blocks._block_widen, types, dict(BITS=bits, **tile))
    fields = {"low_ptr": "*u8", "high_ptr": "*u8", "d_ptr": "*fp16", "sub_ptr": "*i8",
              "dm_ptr": "*fp16", "sub_min_ptr": "*i8"}  # fmt: skip
    # Formats with one formula share the kernels (MXFP4 is Q5_0's, TQ1_0 TQ2_0's), but
    # for d's type (the codebook i-quants' float32: split_blocks.py).
    names: dict = {}
    for code, spec in SUPER_FORMATS.items():
        d_type = "*fp16" if FORMATS[code].factor == 1 else "*fp32"
        names.setdefault((spec, d_type), []).append(code.name)
    for (spec, d_type), codes in names.items():
        types = {**ints, **pointers, **fields, "d_ptr": d_type}
        constants = dict(
            SUPER=spec.super, GROUP=spec.group, HIGH_BITS=spec.high_bits, OFFSET=spec.offset,
            HAS_SUB=spec.has_sub, HAS_MIN=spec.has_min, BLOCK_N=32, BLOCK_K=256,
        )  # fmt: skip
        print(" / ".join(codes))
        build(triton_blocks._super_product, types, dict(constants, DOT=True, BLOCK_M=16))
        build(triton_blocks._super_product, types, dict(constants, DOT=False, BLOCK_M=2))
        build(triton_blocks._super_widen, types, constants)


def attention_kernels() -> None:
    ints = dict.fromkeys(
        ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks",
         "stride_kh", "stride_table", "window", "splits", "keys_per_split", "stride_kt",
         "stride_vt", "stride_vh", "stride_cs", "stride_ch"),
        "i32",
    )  # fmt: skip
    for cache in ("*bf16", "*fp8e4nv", "*u8"):
        int8, fp8 = cache == "*u8", cache == "*fp8e4nv"
        types = {
            **ints, "out_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache,
            "tables_ptr": "*i64", "starts_ptr": "*i64", "computed_ptr": "*i64",
            "part_acc_ptr": "*fp32", "part_top_ptr": "*fp32", "part_total_ptr": "*fp32",
            "sinks_ptr": "*fp32", "scale": "fp32",
        }  # fmt: skip
        # prompt tiles, decode tiles split (flash-decoding), and a verification step's
        # wider tile split (its rows x query heads above 16, a few sequences); a prompt
        # tile and a split decode tile with attention sinks (gpt-oss)
        for split, block_m, block_n, sinks in (
            (False, 64, 64, False), (True, 16, 32, False), (True, 64, 64, False),
            (False, 64, 64, True), (True, 16, 32, True),
        ):  # fmt: skip
            build(
                triton_paged._paged_attention, types,
                dict(G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=block_m, BLOCK_N=block_n,
                     PAGE=16, PRECISION="tf32", SPLIT=split, INT8=int8, SINKS=sinks),
            )  # fmt: skip
        writes = {**ints, "k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": cache,
                  "v_cache_ptr": cache, "slots_ptr": "*i64"}  # fmt: skip
        build(triton_paged._write_kv, writes,
              dict(HEAD_DIM=128, BLOCK_D=128, FP8=fp8, INT8=int8))  # fmt: skip
    combine = {**ints, "out_ptr": "*bf16", "starts_ptr": "*i64", "part_acc_ptr": "*fp32",
               "part_top_ptr": "*fp32", "part_total_ptr": "*fp32",
               "sinks_ptr": "*fp32"}  # fmt: skip
    for block_m, sinks in ((16, False), (64, False), (16, True)):
        build(triton_paged._combine_splits, combine,
              dict(G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=block_m, SPLITS=8,
                   SINKS=sinks))  # fmt: skip


def token_kernels() -> None:
    ints = dict.fromkeys(
        ("heads", "stride_xt", "stride_xh", "stride_rt", "stride_ot", "stride_oh", "q_heads",
         "k_heads", "half", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
         "stride_table", "size", "stride_x", "stride_o"),
        "i32",
    )  # fmt: skip
    types = {**ints, "out_ptr": "*bf16", "x_ptr": "*bf16", "residual_ptr": "*bf16",
             "weight_ptr": "*bf16", "eps": "fp32", "q_ptr": "*bf16", "k_ptr": "*bf16",
             "positions_ptr": "*i64", "table_ptr": "*fp32"}  # fmt: skip
    build(cuda_kernels._rms_norm, types, dict(DIM=4096, BLOCK=4096, HAS_RESIDUAL=True))
    build(cuda_kernels._rotary, types, dict(Q_HEADS=32, K_HEADS=8, HALF=64, ROUND_TABLE=True))
    build(cuda_kernels._act_and_mul, types, dict(GELU=False, BLOCK=1024))


def main() -> int:
    print(f"Triton {triton.__version__}, target {TARGET}")
    block_kernels()
    attention_kernels()
    token_kernels()
    return 0


if __name__ == "__main__":
    sys.exit(main())
