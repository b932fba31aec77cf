"""tandem's quantizers against llama.cpp's, on the same float weights: how many blocks
are byte-for-byte llama.cpp's, and each side's reconstruction error.

llama.cpp's side is ``ggml_quantize_chunk`` (the function llama-quantize calls) from
the build's libggml-base, called through ctypes with no importance matrix. The weights
are every matrix of SmolLM2-135M (its Q4_1 file decoded to float32, the weights a real
model has) and of the random 125M Llama, one row of the table a type:

    python -m benchmarks.quantizer_agreement --llama-bin DIR [--types q3_k q2_k ...]
    python -m benchmarks.quantizer_agreement --llama-bin DIR --files
    python -m benchmarks.quantizer_agreement --llama-bin DIR --write-fixture

``--files``: whole files, scored by llama.cpp. SmolLM2-135M's weights (its Q4_1 file
read by transformers into a Hugging Face folder) are written by ``tandem quantize`` in
each type and by ``llama-quantize --pure`` from tandem's F32 export of the same folder
(the same float32 inputs); the table counts the tensors whose bytes are the same, and
``llama-perplexity --kl-divergence`` scores both files against the F32 one
(benchmarks/quality.py's text): llama.cpp reads tandem's files, at its own quality.

``--write-fixture`` writes tests/reference/llama_cpp_quantized.npz: a few rows of
heavy-tailed float16 weights and llama.cpp's bytes for them in each type, which
tests/test_quant.py holds tandem's quantizers to where no llama.cpp is built.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import gguf
import numpy as np
import torch

from benchmarks.common import llama_125m_folder, machine
from tandem.quant.quantize import FORMATS, quantize

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "reference" / "llama_cpp_quantized.npz"
NEW_TYPES = ["q3_k", "q2_k", "iq4_nl", "iq4_xs", "mxfp4"]


class GGML:
    """libggml-base's quantizer, as llama-quantize calls it."""

    def __init__(self, bin_dir: Path) -> None:
        self.lib = ctypes.CDLL(str(bin_dir / "libggml-base.so"))
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                 ctypes.c_void_p]  # fmt: skip

    def quantize(self, w: torch.Tensor, kind: gguf.GGMLQuantizationType) -> np.ndarray:
        x = np.ascontiguousarray(w.float().numpy())
        weights, nbytes = gguf.GGML_QUANT_SIZES[kind]
        out = np.zeros((x.shape[0], x.shape[1] // weights * nbytes), np.uint8)
        self.lib.ggml_quantize_chunk(int(kind), x.ctypes.data, out.ctypes.data, 0, x.shape[0],
                                     x.shape[1], None)  # fmt: skip
        return out


def fixture_weights() -> torch.Tensor:
    """16 rows of 512: Student-t (3 degrees) weights, rows scaled 1e-3 .. 10, a zero
    block and an all-equal block: float16, as a checkpoint holds them."""
    rng = np.random.default_rng(0)
    w = rng.standard_t(3, size=(16, 512)) * np.logspace(-3, 1, 16)[:, None]
    w[3, :256] = 0
    w[5, 256:] = 0.25
    return torch.from_numpy(w.astype(np.float16)).float()


def matrices(name: str):
    """(name, float32 matrix) for every 2-D tensor of a model whose rows are whole
    blocks of 256."""
    from tandem.models.catalog import resolve_model

    if name == "smollm2":
        from tandem.models.gguf_file import GGUFFile
        from tandem.quant.blocks import dequantize

        reader = GGUFFile(resolve_model("smollm2-135m-instruct"))
        for t in reader.tensors:
            if len(t.shape) == 2 and t.shape[0] % 256 == 0:
                raw = torch.from_numpy(np.array(reader.data(t))).reshape(t.shape[1], -1)
                yield t.name, dequantize(t.type, raw, t.shape[0])
    else:
        from safetensors.torch import load_file

        for key, w in load_file(llama_125m_folder() / "model.safetensors").items():
            if w.dim() == 2 and w.shape[1] % 256 == 0:
                yield key, w.float()


def compare(ggml: GGML, fmt: str, model: str) -> str:
    kind = gguf.GGMLQuantizationType(int(FORMATS[fmt]))
    _, nbytes = gguf.GGML_QUANT_SIZES[kind]
    same = blocks = 0
    ours_error = theirs_error = norm = 0.0
    for _, w in matrices(model):
        ours = quantize(w, FORMATS[fmt]).numpy()
        theirs = ggml.quantize(w, kind)
        same += int((ours.reshape(-1, nbytes) == theirs.reshape(-1, nbytes)).all(-1).sum())
        blocks += ours.size // nbytes
        x = w.double().numpy()
        for raw, which in ((ours, "ours"), (theirs, "theirs")):
            error = float(((gguf.quants.dequantize(raw, kind).reshape(x.shape) - x) ** 2).sum())
            if which == "ours":
                ours_error += error
            else:
                theirs_error += error
        norm += float((x**2).sum())
    return (f"| {model} | {fmt.upper()} | {same / blocks:.2%} | "
            f"{(ours_error / norm) ** 0.5:.4f} | {(theirs_error / norm) ** 0.5:.4f} |")  # fmt: skip


LLAMA_NAMES = {
    "q3_k": "Q3_K_S",
    "q2_k": "Q2_K",
    "iq4_nl": "IQ4_NL",
    "iq4_xs": "IQ4_XS",
    "mxfp4": "MXFP4_MOE",
}  # llama-quantize's names (with --pure: one type)


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (transformers reads its file)."""
    import transformers

    from benchmarks.common import BENCH_DIR
    from tandem.models.catalog import resolve_model

    folder = BENCH_DIR / "smollm2-135m-hf"
    if not (folder / "model.safetensors").is_file():
        path = Path(resolve_model("smollm2-135m-instruct"))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        # (transformers will not save a model it read from GGUF: its tensors and config)
        from safetensors.torch import save_file

        state = {
            k: v.contiguous().clone()
            for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
        }
        folder.mkdir(parents=True, exist_ok=True)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        model.config.quantization_config = None
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer.save_pretrained(folder)
    return folder


def file_rows(bin_dir: Path, types: list[str], ctx: int) -> None:
    import subprocess
    import tempfile

    from benchmarks.quality import LlamaCpp, stdlib_text
    from tandem.models.gguf_export import export_gguf

    folder = smollm2_folder()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        f32 = export_gguf(folder, work / "smollm2-f32.gguf", "f32")
        llama = LlamaCpp(bin_dir, f32, stdlib_text(), ctx, work)
        print("| file | KLD | 99% KLD | same top | PPL(Q)/PPL(base) | RMS dp | tensors equal |")
        print("|---|---|---|---|---|---|---|")
        for fmt in types:
            ours = export_gguf(folder, work / f"tandem-{fmt}.gguf", fmt)
            theirs = work / f"llama-{fmt}.gguf"
            subprocess.run([str(bin_dir / "llama-quantize"), "--pure", str(f32), str(theirs),
                            LLAMA_NAMES[fmt]], capture_output=True, check=True)  # fmt: skip
            a = {t.name: t for t in gguf.GGUFReader(ours).tensors}
            b = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
            equal = sum(
                a[n].tensor_type == b[n].tensor_type
                and np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data))
                for n in a
            )
            for name, path in (
                (f"tandem quantize --type {fmt}", ours),
                (f"llama-quantize --pure {LLAMA_NAMES[fmt]}", theirs),
            ):
                row = llama.row(name, path).replace("**", "").removesuffix(" |")
                print(f"{row} {equal} of {len(a)} |", flush=True)


def write_fixture(ggml: GGML) -> None:
    w = fixture_weights()
    arrays = {"weights": w.half().numpy()}
    for fmt in NEW_TYPES:
        arrays[fmt] = ggml.quantize(w, gguf.GGMLQuantizationType(int(FORMATS[fmt])))
    FIXTURE.parent.mkdir(exist_ok=True)
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llama-bin",
        type=Path,
        required=True,
        help="a llama.cpp build's bin/ folder (holding libggml-base.so)",
    )
    parser.add_argument("--types", nargs="*", default=NEW_TYPES, choices=list(FORMATS))
    parser.add_argument(
        "--models", nargs="*", default=["smollm2", "llama-125m"], choices=["smollm2", "llama-125m"]
    )
    parser.add_argument("--write-fixture", action="store_true")
    parser.add_argument("--files", action="store_true")
    parser.add_argument("--ctx", type=int, default=512)
    args = parser.parse_args()  # fmt: skip
    ggml = GGML(args.llama_bin)
    if args.write_fixture:
        write_fixture(ggml)
        return
    print(machine())
    if args.files:
        file_rows(args.llama_bin, args.types, args.ctx)
        return
    print("| weights | type | blocks equal to llama.cpp's | RMSE / RMS, tandem | llama.cpp |")
    print("|---|---|---|---|---|")
    for model in args.models:
        for fmt in args.types:
            print(compare(ggml, fmt, model), flush=True)


if __name__ == "__main__":
    main()
