"""tandem's CPU kernels, compiled on first use, and when to use them.

parallel.cpp: work shared among the threads from one counter (tiles, attention's
items), so that a thread that is ahead takes more.

cpu_ops.cpp: everything in a decoder layer that is not a weight matmul: RMSNorm with
the residual add fused in (and per head, for q/k norms), rotary in place, silu(gate) *
up and gelu_tanh(gate) * up, the KV-cache write, and
paged decode attention that reads each K/V row once, straight from the blocks. Eager
torch spends about 40 small ops per layer on these; the kernels make it 7 calls. Also
the small-batch float linear layer and greedy argmax.

quant_ops.cpp: linear layers on weights kept in llama.cpp's block formats, with
integer dot products (tandem/quant/); prompt-sized passes on AMX tile registers where
the CPU and its kernel give them (``amx_mode``; TANDEM_AMX=0 declines them).

codebook_ops.cpp: the codebook i-quants' super-blocks decoded through their grids,
by quant_ops.cpp as it multiplies (those types are held as the file's blocks).

pack_ops.cpp: a GGUF tensor's block bytes repacked into quant_ops.cpp's tiled layout
at load, in one pass across threads.

decode_layer.cpp: a whole Llama-family (or Gemma 3) decoder layer for decode tokens, the calls
above made from C++ (runner/fused_decode.py decides when).
moe_ops.cpp: a mixture's routing and experts, and its whole decode layer.
shm_ops.cpp: the counters through which tensor-parallel ranks on one host wait for each
other in shared memory (runner/shm_group.py).
decode_stack.cpp: every decoder layer of a decode step in one call, those layer calls
made one after the other from C++ (on a tensor-parallel rank, with the all-reduces
between them).
read_probe.cpp: every byte of a tensor read once, as the kernels stream: the machine's
read bandwidth that decode is measured against (plan/measure.py).
quantize_ops.cpp: float weights -> Q3_K, Q2_K, IQ4_NL and IQ4_XS blocks by llama.cpp's
scale searches, across threads (quant/quantize.py; `tandem quantize`).
delta_rule_ops.cpp: the gated delta rule's decode step, each state read and written in
place in its slot (a hybrid's linear-attention layers: kernels/delta_rule.py), and a
whole Gated DeltaNet decode step after its projection (conv, norms, gates, the rule).
short_conv_ops.cpp: LFM2's gated short convolution for decode tokens in their slots, and
its whole convolution layer (with the MLP) in one call.
ssd_ops.cpp: a Mamba-2 mixer's decode step after its projection (conv, dt, the SSD
state read and written once in its slot, the D skip, the gated grouped norm).

The module is built with torch.utils.cpp_extension (gcc and ninja) the first time it
is needed and cached by torch, keyed on the CPU's flags since it is compiled with
``-march=native``, and on the install (torch version, environment prefix); another
install of the same torch and Python takes a module already built (``built_elsewhere``)
instead of compiling it again. A build lock left by a killed process is detected (its
pid is gone) and removed; a live builder is waited for at most TANDEM_KERNEL_BUILD_WAIT
seconds (600), then torch ops are used; both say so on stderr. If building fails (no
compiler), or TANDEM_CPU_KERNELS=0, ``load`` returns None and every caller falls back
to torch ops; the tests check both paths against each other and against transformers.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# One translation unit, in this order: parallel.cpp's work sharing is used by the next
# two, codebook_ops.cpp's decoder by quant_ops.cpp and pack_ops.cpp, decode_layer.cpp and
# moe_ops.cpp call those, decode_stack.cpp the layers and shm_ops.cpp's all-reduce,
# short_conv_ops.cpp decode_layer.cpp's and delta_rule_ops.cpp's, ssd_ops.cpp the latter's.
SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "parallel.cpp",
        "cpu_ops.cpp",
        "codebook_ops.cpp",
        "quant_ops.cpp",
        "pack_ops.cpp",
        "decode_layer.cpp",
        "moe_ops.cpp",
        "shm_ops.cpp",
        "decode_stack.cpp",
        "read_probe.cpp",
        "quantize_ops.cpp",
        "delta_rule_ops.cpp",
        "short_conv_ops.cpp",
        "ssd_ops.cpp",
    )
]
FUNCTIONS = [
    "rms_norm",
    "rms_norm_heads",
    "rotary",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "clamped_swiglu_and_mul",
    "write_kv",
    "decode_attention",
    "paged_attention_rows",
    "small_linear",
    "argmax_rows",
    "mask_rows",
    "quant_linear",
    "amx_mode",
    "compact_layouts",
    "quant_rows",
    "pack_ggml",
    "set_codebook_grid",
    "llama_decode_layer",
    "llama_decode_attention",
    "llama_decode_mlp",
    "moe_route",
    "moe_experts",
    "llama_decode_moe_layer",
    "llama_decode_stack",
    "llama_decode_stack_ranked",
    "shm_post",
    "shm_wait",
    "shm_all_reduce",
    "read_stream",
    "quantize_ggml",
    "gated_delta_step",
    "gated_delta_net_step",
    "short_conv_step",
    "short_conv_decode_layer",
    "mamba2_step",
]


# How the module is compiled (benchmarks/quantized_kernels.py builds an older
# quant_ops.cpp the same way, to compare). Tuples, passed as fresh lists: torch appends
# its libraries to the ldflags list it is given, and a second build in one process
# (after load.cache_clear) then hashed differently, was renamed ..._v1 and rewrote the
# build folder's ninja file, so that every later process rebuilt the module (about
# 110 s each on a 2-core VM).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)


def _flags() -> str:
    """The CPU's flags line (/proc/cpuinfo), or what the platform says of it."""
    try:
        return next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return platform.processor()


def has_bf16_units() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX). Without,
    torch emulates it, many times slower than float32."""
    return bool({"avx512_bf16", "amx_bf16"} & set(_flags().split()))


def _cpu_tag() -> str:
    """The build uses -march=native, so the cached module is keyed on the CPU's flags
    and the source: a cache carried to another machine is never loaded there."""
    flags = _flags()
    sources = b"".join(path.read_bytes() for path in SOURCES)
    return hashlib.sha1(flags.encode() + sources).hexdigest()[:10]


def build_directory(name: str) -> Path:
    """Where ``name`` is built: under torch's extensions folder (TORCH_EXTENSIONS_DIR),
    one folder per install. Two environments on one machine embed different torch
    paths in the build, so a shared folder made each rebuild the other's module."""
    from torch.utils.cpp_extension import _get_build_directory

    base = Path(_get_build_directory(name, verbose=False)).parent
    install = hashlib.sha1(f"{torch.__version__}|{sys.prefix}".encode()).hexdigest()[:8]
    return base / f"{name}_{install}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's, and running
    return True


@contextlib.contextmanager
def build_lock(directory: Path, wait_s: float):
    """Held around torch's build (which takes its own ``lock`` file and waits forever
    on a lock its holder left when it was killed). Ours records the holder's pid: a
    lock whose process is gone is stale and removed, a live one is waited for at most
    ``wait_s`` seconds (TimeoutError: the caller falls back to torch ops). Holding
    ours, any ``lock`` of torch's in the folder is a dead builder's and is removed.

    Yields ``building()``, which the holder calls when it is about to compile (the
    lock then reads "<pid> building"): a waiter says it waits for a build only then,
    not while the holder merely loads a module already built (a second or so, as
    when several tandem processes start at once)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tandem.lock"
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                text = path.read_text()
                holder = int(text.split()[0]) if text.strip() else 0
                age = time.time() - path.stat().st_mtime
            except FileNotFoundError:
                continue  # released between our two looks
            except (OSError, ValueError):
                text, holder, age = "", 0, 0.0
            # No pid yet: being created (wait) or its creator died at once (old).
            stale = not _alive(holder) if holder else age > 10
            if stale:
                print(f"tandem: removing a stale kernel-build lock (pid {holder} is gone)",
                      file=sys.stderr)  # fmt: skip
                path.unlink(missing_ok=True)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"another process (pid {holder}) has held the lock on building the CPU "
                    f"kernels in {directory} for over {wait_s:.0f} s"
                ) from None
            if not announced and text.endswith("building"):
                print(f"tandem: waiting for process {holder} to finish building the CPU "
                      "kernels", file=sys.stderr)  # fmt: skip
                announced = True
            time.sleep(0.2)
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(str(os.getpid()))
        break

    def building() -> None:
        path.write_text(f"{os.getpid()} building")

    try:
        (directory / "lock").unlink(missing_ok=True)
        yield building
    finally:
        path.unlink(missing_ok=True)


STAMP = "built_for.txt"


def install_stamp() -> str:
    """What a built module depends on besides its sources and the CPU (both in its
    name): torch's version and build (its C++ ABI), the interpreter's, and the flags it
    was compiled and linked with (torch's own build in a folder notices changed flags
    and compiles again; a module taken from another folder must match them itself)."""
    flags = " ".join((*COMPILE_FLAGS, *LINK_FLAGS))
    return f"torch {torch.__version__}, {sys.implementation.cache_tag}{sys.abiflags}, {flags}"


def _stamp(directory: Path, module_file: Path) -> None:
    """Records, beside a finished build, what it was built for and which file it is
    (written after the module loaded, so a stamp never names a half-written file)."""
    text = f"{install_stamp()}\n{module_file.name}\n"
    path = directory / STAMP
    if path.exists() and path.read_text() == text:
        return
    partial = directory / f"{STAMP}.{os.getpid()}"
    partial.write_text(text)
    partial.replace(path)


def built_elsewhere(name: str, directory: Path) -> Path | None:
    """The module ``name`` as another install on this machine built it (another virtual
    environment: each builds in a folder of its own, ``build_directory``), if that
    install has the same torch and Python, so that one machine compiles these sources
    once per torch rather than once per environment (CI's main job and test job, two
    environments, compiled them twice: about two minutes each on 2 cores). The module
    is loaded from that folder as it is; torch's build, which would compile again
    against this install's headers, is not involved."""
    for other in sorted(directory.parent.glob(f"{name}_*")):
        if other == directory:
            continue
        try:
            stamp, module_file = (other / STAMP).read_text().splitlines()[:2]
        except (OSError, ValueError):
            continue
        if stamp == install_stamp() and (other / module_file).is_file():
            return other / module_file
    return None


def _import_built(name: str, path: Path):
    """Imports the compiled extension module at ``path`` (its init function is named
    after ``name``, the build's TORCH_EXTENSION_NAME)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    logger.info("CPU kernels: the module built by another install, %s", path)
    return module


@functools.cache
def load():
    """The compiled module, or None when it cannot (or should not) be built."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        name = f"tandem_cpu_ops_{_cpu_tag()}"
        directory = build_directory(name)
        wait_s = float(os.environ.get("TANDEM_KERNEL_BUILD_WAIT", "600"))
        with build_lock(directory, wait_s) as building:
            if not any(directory.glob(f"{name}*.so")):
                elsewhere = built_elsewhere(name, directory)
                if elsewhere is not None:
                    return _import_built(name, elsewhere)
                building()
                print(
                    "tandem: compiling the CPU kernels (first use only, one to two minutes; "
                    "TANDEM_CPU_KERNELS=0 skips them)",
                    file=sys.stderr,
                )
            module = load_inline(
                name=name,
                cpp_sources=[path.read_text() for path in SOURCES],
                functions=FUNCTIONS,
                extra_cflags=list(COMPILE_FLAGS),
                extra_ldflags=list(LINK_FLAGS),
                build_directory=str(directory),
                verbose=False,
                **_only_our_headers(load_inline),
            )
            _stamp(directory, Path(module.__file__))
            return module
    except Exception as exc:  # no compiler, no ninja, no headers, a stuck build: torch ops
        logger.warning("CPU kernels unavailable, using torch ops: %s", exc)
        print(f"tandem: CPU kernels unavailable, using torch ops ({exc})", file=sys.stderr)
        return None


def _only_our_headers(load_inline) -> dict:
    """The sources include what they use (torch/python.h); torch would add
    torch/extension.h in front, whose C++ frontend (modules, optimizers, data loaders)
    none of them uses: 111 s -> 86 s of a build on a 2-core Zen 3. Older torch builds
    cannot leave it out, and compile it as before."""
    import inspect

    known = inspect.signature(load_inline).parameters
    return {"no_implicit_headers": True} if "no_implicit_headers" in known else {}


def reads_compact_layouts() -> bool:
    """Whether this machine's build reads the compact layouts, 4-bit table values and
    2- and 3-bit values (quant_ops.cpp's kCompactLayouts: not where the CPU has AVX-512
    F, BW and VNNI), without building: the built module's answer once it is loaded, else
    the same rule from the CPU's flags (so that pricing a file, ``tandem plan``,
    compiles nothing)."""
    if load.cache_info().currsize:
        module = load()
        return module is not None and bool(module.compact_layouts())
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return False
    return not {"avx512f", "avx512bw", "avx512_vnni"} <= set(_flags().split())


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [S, H, D] (one token per sequence; tokens may be strided), k/v blocks
    [num_blocks, block_size, Hkv, D] -> [S, H, D]; ``sinks`` [H]: each query head's
    sink logit (gpt-oss). Requires ``load()``."""
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    load().decode_attention(
        out, q, k_blocks, v_blocks, block_tables, context_lens, scale, sliding_window or 0,
        _sink_logits(sinks),
    )  # fmt: skip
    return out


def _sink_logits(sinks: torch.Tensor | None) -> torch.Tensor:
    """The kernels' ``sinks``: float32 [H], or empty for none."""
    if sinks is None:
        return torch.empty(0, dtype=torch.float32)
    return sinks.detach().float().contiguous()


def paged_attention_rows(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    row_lens: torch.Tensor,
    row_starts: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A few query rows per sequence straight from the blocks (speculative
    verification, short chunks): q [R, H, D], the rows of sequence s being
    ``row_starts[s]:row_starts[s + 1]`` and row r attending to the first
    ``row_lens[r]`` tokens of its sequence (``sinks`` as decode_attention's). Each
    sequence's K/V is read once for all of its rows. Requires ``load()``."""
    out = torch.empty(q.shape, dtype=q.dtype)
    load().paged_attention_rows(
        out, q, k_blocks, v_blocks, block_tables, row_lens, row_starts, scale,
        sliding_window or 0, _sink_logits(sinks),
    )  # fmt: skip
    return out
