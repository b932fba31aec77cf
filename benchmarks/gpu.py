"""The CUDA path against the GPU's own ceilings: decode against the memory floor,
batching's cost, prefill against the matrix units, and the host's time per step.

    python benchmarks/gpu.py [--models smollm2-135m,llama-3.2-1b,llama-3.1-8b]
                             [--weights bf16,q4_0,q4_k_m] [--out results.json]

Ceilings are measured first, on this GPU: the copy rate (a 2 GiB device-to-device
copy, bytes read plus written) and the bfloat16 matrix rate (8192^3 on random data).
Models are random-weight files of real shapes (tandem.models.random_gguf): ``bf16``
drawn on the GPU, ``q4_0`` (or ``q8_0``, ``q4_k_m``, ``q5_k_m``) a GGUF file written
to --files and loaded as a user would (every matrix in its blocks: Q4_0's file keeps
its output matrix in Q6_K, a Q4_K_M file mixes Q4_K and Q6_K).

For each model and batch size B, B sequences of --context tokens are prefilled, then
decode steps are timed (median of --steps, each ended by a synchronize, as the
engine's step ends by reading its tokens), through CUDA graphs and eagerly, and
speculation's verification steps (each sequence's token and --drafts guesses, every
row's logits; graphs, and eagerly at B=1). A step
must read every weight once: its floor is the bytes the model holds (embedding table
excepted: a step reads B rows of it) plus the KV it attends, over the copy rate.
"Host" is the time the step's call takes to return before the GPU finishes (with
graphs: filling the inputs, one copy, one replay).

Prefill: one --prefill-token prompt; its FLOPs are 2 x tokens x matrix weights plus
causal attention's 2 x 2 x layers x heads x head_dim x tokens^2 / 2, over the
measured matrix rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.common import machine
from tandem.models.loader import load_model
from tandem.models.random_gguf import SHAPES, write_random_gguf
from tandem.models.random_weights import random_model
from tandem.quant.split_blocks import block_parts
from tandem.runner.model_runner import ModelRunner, SequenceChunk

DATASHEET_TBS = {"H100": 3.35, "H200": 4.8}  # HBM, SXM parts


def events_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bfloat16 per buffer, far past the L2
    buffers = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    turn = [0]

    def copy():
        a, b = buffers[turn[0] % 3], buffers[(turn[0] + 1) % 3]
        b.copy_(a)
        turn[0] += 1

    copy()
    copy_ms = events_ms(copy, 20)
    buffers.clear()
    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    torch.matmul(a, b)
    matmul_ms = events_ms(lambda: torch.matmul(a, b), 20)
    return {
        "copy_tb_s": 2 * n * 2 / copy_ms / 1e9,
        "bf16_tflops": 2 * size**3 / matmul_ms / 1e9,
    }


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: every parameter and block part but
    the token embedding table (a tied LM head reads it whole: counted there)."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        total += sum(weight.nbytes for _, weight in block_parts(module))
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
    return total


def matrix_weights(config) -> int:
    """Weights of the per-token matrices (attention and MLP projections)."""
    h, layers = config.hidden_size, config.num_layers
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return layers * (h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size)


def load(name: str, weights: str, files: Path):
    shape = SHAPES[name]
    if weights == "bf16":
        return random_model(shape.raw_config(), "bfloat16", "cuda")
    path = files / f"{name}-{weights}.gguf"
    partial = path.with_name(path.name + ".partial")  # being written by another process
    while partial.exists() and not path.exists():
        time.sleep(1)
    if not path.exists():
        write_random_gguf(path, shape, weights)  # (ValueError: no such file of this shape)
    return load_model(path, dtype="bfloat16", device="cuda")


def decode_steps(
    runner, batch: int, context: int, steps: int, graphs: bool, drafts: int = 0
) -> dict:
    """Median step of ``batch`` sequences after ``context`` tokens: one token each, or
    with ``drafts`` a verification step (the last token and ``drafts`` guesses each,
    every row's logits, as speculation's steps are)."""
    block = runner.block_size
    rows = 1 + drafts
    per_seq = -(-(context + (steps + 4) * rows) // block)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    generator = torch.Generator().manual_seed(batch)
    vocab = runner.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, context), generator=generator).tolist()
    for first in range(0, batch, 8):  # prefill 8 sequences at a time
        runner.forward([SequenceChunk(prompts[i], 0, tables[i])
                        for i in range(first, min(batch, first + 8))])  # fmt: skip
    saved = runner.graphs
    if not graphs:
        runner.graphs = None
    tokens = [1] * batch
    wall, host = [], []
    guesses = list(range(11, 11 + drafts))
    try:
        for step in range(steps + 3):
            done = context + step * rows
            chunks = [SequenceChunk([tokens[i], *guesses], done, tables[i], drafts > 0)
                      for i in range(batch)]  # fmt: skip
            torch.cuda.synchronize()
            start = time.perf_counter()
            logits = runner.forward(chunks, all_logits=drafts > 0)
            returned = time.perf_counter()
            # the step's end: its tokens on the host (each sequence's last row goes on)
            tokens = logits.argmax(-1).tolist()[rows - 1 :: rows]
            end = time.perf_counter()
            if step >= 3:  # the first steps capture graphs and compile kernels
                wall.append(end - start)
                host.append(returned - start)
    finally:
        runner.graphs = saved
    return {"step_ms": 1e3 * statistics.median(wall), "host_ms": 1e3 * statistics.median(host)}


def prefill(runner, tokens: int) -> float:
    vocab = runner.config.vocab_size
    prompt = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(7))
    table = list(range(-(-tokens // runner.block_size)))
    chunk = [SequenceChunk(prompt.tolist(), 0, table)]
    runner.forward(chunk)  # warm-up
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.forward(chunk)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--weights", default="bf16,q4_0,q4_k_m")
    parser.add_argument("--batches", default="1,8,16,32,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--drafts", type=int, default=4,
        help="also time verification steps of 1 + this many rows a sequence (0: not)",
    )  # fmt: skip
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--files", default="/tmp/tandem-gpu-models")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    files = Path(args.files)
    files.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name()
    driver = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    import triton

    info = {
        "gpu": name,
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "host": machine(),
    }  # (host: "host" times depend on the CPU that launches the kernels)
    print(json.dumps(info))
    ceiling = ceilings()
    sheet = next((v for k, v in DATASHEET_TBS.items() if k in name), None)
    print(f"copy {ceiling['copy_tb_s']:.2f} TB/s (datasheet {sheet} TB/s), "
          f"bf16 matmul {ceiling['bf16_tflops']:.0f} TFLOP/s")  # fmt: skip
    results = {"info": info, "ceilings": ceiling, "decode": [], "prefill": []}
    batches = [int(b) for b in args.batches.split(",")]
    for model_name in args.models.split(","):
        for weights in args.weights.split(","):
            started = time.perf_counter()
            try:
                loaded = load(model_name, weights, files)
            except ValueError:  # SmolLM2's 576 columns are no whole blocks of Q6_K (its
                weights = "q8_0"  # Q4_0 file's output matrix): its Q8_0 file instead
                loaded = load(model_name, weights, files)
            load_s = time.perf_counter() - started
            config = loaded.config
            per_seq = -(-(args.context + (args.steps + 4) * (1 + args.drafts)) // 16)
            num_blocks = max(max(batches) * per_seq, -(-args.prefill_tokens // 16))
            runner = ModelRunner(loaded, num_blocks, 16, cuda_graph_batch=max(batches))
            weight_bytes = model_bytes(loaded.model)
            kv_per_token = runner.kv_cache[0, :, 0, 0].numel() * runner.kv_cache.element_size()
            kv_per_token *= config.num_layers
            for batch in batches:
                graphed = decode_steps(runner, batch, args.context, args.steps, graphs=True)
                row = {
                    "model": model_name, "weights": weights, "batch": batch, "load_s": load_s,
                    "weight_bytes": weight_bytes, "graph_step_ms": graphed["step_ms"],
                    "graph_host_ms": graphed["host_ms"],
                }  # fmt: skip
                if batch in (1, max(batches)):
                    eager = decode_steps(runner, batch, args.context, args.steps, graphs=False)
                    row.update(eager_step_ms=eager["step_ms"], eager_host_ms=eager["host_ms"])
                if args.drafts:  # speculation's step: each sequence's token and its drafts
                    verify = decode_steps(
                        runner, batch, args.context, args.steps, graphs=True, drafts=args.drafts
                    )
                    row.update(verify_step_ms=verify["step_ms"], verify_host_ms=verify["host_ms"])
                    if batch == 1:
                        verify = decode_steps(runner, batch, args.context, args.steps,
                                              graphs=False, drafts=args.drafts)  # fmt: skip
                        row["eager_verify_step_ms"] = verify["step_ms"]
                read = weight_bytes + batch * (args.context + args.steps) * kv_per_token
                row["floor_ms"] = read / ceiling["copy_tb_s"] / 1e9
                row["of_floor"] = row["floor_ms"] / row["graph_step_ms"]
                results["decode"].append(row)
                print(
                    f"{model_name:>14} {weights:>5} B={batch:<3} step {row['graph_step_ms']:.3f} ms"
                    f" (eager {row.get('eager_step_ms', float('nan')):.3f}) host "
                    f"{1e3 * row['graph_host_ms']:.0f} us; floor {row['floor_ms']:.3f} ms "
                    f"({weight_bytes / 1e9:.2f} GB): {100 * row['of_floor']:.0f}% of floor"
                    + (f"; verifying {args.drafts} drafts {row['verify_step_ms']:.3f} ms"
                       f" (eager {row.get('eager_verify_step_ms', float('nan')):.3f})"
                       if args.drafts else ""),
                    flush=True,
                )  # fmt: skip
            seconds = prefill(runner, args.prefill_tokens)
            t = args.prefill_tokens
            attention = 2 * config.num_layers * config.num_heads * config.head_dim * t * t
            flops = 2 * t * matrix_weights(config) + attention
            row = {"model": model_name, "weights": weights, "tokens": t, "seconds": seconds,
                   "tflops": flops / seconds / 1e12}  # fmt: skip
            row["of_peak"] = row["tflops"] / ceiling["bf16_tflops"]
            results["prefill"].append(row)
            print(f"{model_name:>14} {weights:>5} prefill {t}: {1e3 * seconds:.1f} ms, "
                  f"{row['tflops']:.0f} TFLOP/s ({100 * row['of_peak']:.0f}% of the measured peak)",
                  flush=True)  # fmt: skip
            del runner, loaded
            torch.cuda.empty_cache()
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))
    from tandem.runner.linear import triton_blocks

    # The block matmul's kernel per (N, K, rows of a program, format) and tiles per shape
    results["block_matmul_kernels"] = triton_blocks.chosen_kernels()
    results["block_matmul_tiles"] = triton_blocks.tuned_tiles()
    for key, kernel in results["block_matmul_kernels"].items():
        print(f"block matmul (N, K, rows of a program, format) {key}: {kernel}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
