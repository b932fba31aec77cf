"""tandem against llama.cpp on the same GGUF files, same machine, same run.

Per file: batch-1 decode tok/s (after a 128-token prompt), batch-16 decode tok/s (16
prompts of 128, 128 new tokens each) and prefill tok/s at 512 tokens; each decode
figure also as a fraction of the memory-bandwidth floor (the weight bytes one decode
step reads / the measured read bandwidth; a batch of 16 reads them once for 16
tokens). Greedy, 2 threads each, medians of repetitions.

Files: SmolLM2-135M-Instruct as installed (Q4_1, its Q8_0 embedding doubling as the
tied LM head) and requantized by llama.cpp's llama-quantize to Q8_0 and Q4_0; Gemma 3
270M (Q4_K_M, when its package is installed: its 262k x 640 Q8_0 embedding, the tied
LM head, is two thirds of a decode step's bytes); and the
random-weight 125M Llama of benchmarks/common.py written by tandem's exporter in F16,
Q8_0, Q4_0 and MXFP4 (so this also shows llama.cpp loading tandem's files), and that F16 file
quantized by llama-quantize to Q3_K_S, IQ4_NL, TQ2_0 and TQ1_0.

llama.cpp: llama-bench (tg at depth 128, pp512) and llama-batched-bench (16 x 128 +
128), built from the llama-cpp-python sdist::

    pip download --no-binary :all: --no-deps llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
        && cmake --build build -j2 --target llama-bench llama-batched-bench llama-quantize

    python -m benchmarks.quantized_decode --llama-bin .../vendor/llama.cpp/build/bin
    python -m benchmarks.quantized_decode --greedy   # tokens, against llama-cpp-python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.common import BENCH_DIR, llama_125m_folder, machine
from benchmarks.decode_roofline import tandem_step_seconds
from tandem import LLM, SamplingParams
from tandem.models.catalog import is_installed, resolve_model
from tandem.models.gguf_export import export_gguf
from tandem.plan.measure import memory_bandwidth_gbs

THREADS = 2


def step_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads: every matrix, and the embedding table
    only when it is also the LM head (tied); one embedding row is negligible."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    return sum(
        int(t.n_bytes)
        for t in reader.tensors
        if len(t.shape) == 2 and (t.name != "token_embd.weight" or tied)
    )


def prepare_files(llama_bin: Path | None) -> dict[str, Path]:
    folder = BENCH_DIR / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    files = {"smollm2 Q4_1": Path(resolve_model("smollm2-135m-instruct"))}
    if is_installed("gemma3-270m"):  # Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K; a 262k vocabulary
        files["gemma3-270m Q4_K_M"] = Path(resolve_model("gemma3-270m"))
    for fmt in ("Q8_0", "Q4_0"):
        out = folder / f"smollm2-{fmt.lower()}.gguf"
        if not out.is_file() and llama_bin is not None:
            subprocess.run(
                [str(llama_bin / "llama-quantize"), "--allow-requantize",
                 str(files["smollm2 Q4_1"]), str(out), fmt],
                check=True, capture_output=True,
            )  # fmt: skip
        if out.is_file():
            files[f"smollm2 {fmt}"] = out
    for fmt in ("f16", "q8_0", "q4_0", "mxfp4"):  # (tandem's MXFP4: llama-quantize --pure's bytes)
        out = folder / f"llama125m-{fmt}.gguf"
        if not out.is_file():
            export_gguf(llama_125m_folder(), out, fmt)
        files[f"llama-125m {fmt.upper()}"] = out
    # Its F16 file quantized by llama.cpp to the types tandem reads since (every matrix
    # of the 768-wide model takes whole 256-weight super-blocks).
    for fmt in ("Q3_K_S", "Q2_K", "IQ4_NL", "IQ4_XS", "TQ2_0", "TQ1_0"):
        out = folder / f"llama125m-{fmt.lower()}.gguf"
        if not out.is_file() and llama_bin is not None:
            subprocess.run(
                [str(llama_bin / "llama-quantize"), str(files["llama-125m F16"]), str(out), fmt],
                check=True, capture_output=True,
            )  # fmt: skip
        if out.is_file():
            files[f"llama-125m {fmt}"] = out
    return files


def tandem_figures(path: Path, repeats: int, quantization: str = "auto") -> dict[str, float]:
    llm = LLM(str(path), max_num_seqs=16, max_num_batched_tokens=2048, quantization=quantization)
    vocab = llm.engine.executor.runner.model.config.vocab_size
    tandem_step_seconds(llm, 1, 128, 128)  # warm-up, as llama-bench does one
    b1 = statistics.median(tandem_step_seconds(llm, 1, 128, 128) for _ in range(repeats))
    b16 = statistics.median(tandem_step_seconds(llm, 16, 128, 128) for _ in range(repeats))
    prefill = []
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for r in range(repeats + 1):
        prompt = [(r * 31 + j * 7) % vocab for j in range(512)]  # no prefix reuse
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        prefill.append(time.perf_counter() - start)
    return {"b1": 1 / b1, "b16": 16 / b16, "pp512": 512 / statistics.median(prefill[1:])}


def llama_cpp_figures(llama_bin: Path, path: Path, repeats: int) -> dict[str, float]:
    def bench(*flags: str) -> float:
        out = subprocess.run(
            [str(llama_bin / "llama-bench"), "-m", str(path), "-t", str(THREADS),
             "-r", str(repeats), "-o", "json", *flags],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        return json.loads(out)[0]["avg_ts"]

    batched = subprocess.run(
        [str(llama_bin / "llama-batched-bench"), "-m", str(path), "-t", str(THREADS),
         "-npp", "128", "-ntg", "128", "-npl", "16", "-c", "4200"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    row = next(
        line for line in batched.splitlines() if re.match(r"\|\s+128 \|\s+128 \|\s+16 \|", line)
    )
    b16 = float(row.split("|")[8])  # S_TG t/s
    return {"b1": bench("-p", "0", "-n", "128", "-d", "128"), "b16": b16,
            "pp512": bench("-p", "512", "-n", "0")}  # fmt: skip


QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Name three primary colors.",
]


def greedy_against_llama_cpp(path: Path, new_tokens: int = 12) -> None:
    """Greedy tokens of both engines on chat prompts (llama-cpp-python's bindings of
    the same llama.cpp): quantized activations are an approximation both make."""
    from llama_cpp import Llama

    theirs = Llama(str(path), n_threads=THREADS, verbose=False)
    ours = LLM(str(path))
    exact = LLM(str(path), quantization="none")
    tokenizer = ours.get_tokenizer()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for question in QUESTIONS:
        ids = tokenizer.encode_chat([{"role": "user", "content": question}])
        theirs.reset()
        reference = []
        for token in theirs.generate(ids, temp=0.0, top_k=1):
            reference.append(token)
            if len(reference) == new_tokens:
                break
        prompt = [{"prompt_token_ids": ids}]
        mine = ours.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        dequantized = exact.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        pairs = zip(mine.token_ids, reference, strict=True)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        print(f"{question}\n  tandem:     {mine.text!r}\n  llama.cpp:  "
              f"{tokenizer.decode(reference)!r}\n  dequantized weights (transformers' path): "
              f"{dequantized.text!r}\n  first difference tandem / llama.cpp: "
              f"{'none' if same is None else f'token {same}'}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llama-bin",
        type=Path,
        default=os.environ.get("LLAMA_BIN"),
        help="folder with llama-bench, llama-batched-bench, llama-quantize",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", nargs="*", help="only these (names as printed)")
    parser.add_argument(
        "--quantization",
        default="auto",
        help="tandem's --quantization (none: the weights dequantized to float32 at load, "
        "torch's matmuls: the dequantize-then-matmul path, for comparison)",
    )
    parser.add_argument(
        "--greedy",
        action="store_true",
        help="instead: greedy tokens of tandem and llama-cpp-python on SmolLM2's file",
    )
    args = parser.parse_args()
    if args.greedy:
        greedy_against_llama_cpp(Path(resolve_model("smollm2-135m-instruct")))
        return
    torch.set_num_threads(THREADS)
    files = prepare_files(args.llama_bin)
    bandwidth = memory_bandwidth_gbs()
    print(f"machine: {machine()}; measured read bandwidth {bandwidth:.1f} GB/s")
    print(f"{THREADS} threads; decode after a 128-token prompt; medians of {args.repeats}\n")
    print(
        f"{'file':<20}{'MB/step':>8}  {'engine':<10}{'b1 tok/s':>9}{'of floor':>9}"
        f"{'b16 tok/s':>10}{'of floor':>9}{'pp512 tok/s':>12}"
    )
    for name, path in files.items():
        if args.files and name not in args.files:
            continue
        nbytes = step_bytes(path)
        floor = bandwidth * 1e9 / nbytes  # decode steps per second the bandwidth allows
        rows = [("tandem", tandem_figures(path, args.repeats, args.quantization))]
        if args.llama_bin is not None:
            rows.append(("llama.cpp", llama_cpp_figures(args.llama_bin, path, args.repeats)))
        for engine, f in rows:
            b1, b16 = f["b1"], f["b16"]
            print(
                f"{name:<20}{nbytes / 1e6:>8.1f}  {engine:<10}{b1:>9.1f}{b1 / floor:>9.0%}"
                f"{b16:>10.1f}{b16 / (16 * floor):>9.0%}{f['pp512']:>12.1f}"
            )
        if len(rows) == 2:
            ours, theirs = rows[0][1], rows[1][1]
            ratios = "  ".join(f"{k} {ours[k] / theirs[k]:.2f}x" for k in ("b1", "b16", "pp512"))
            print(f"{'':<20}{'':>8}  tandem / llama.cpp: {ratios}")


if __name__ == "__main__":
    main()
