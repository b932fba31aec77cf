"""Paged attention paths against brute-force attention over each sequence's context."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.runner import cuda_graphs
from tandem.runner.attention import BACKENDS, build_paged_metadata, torch_sdpa, triton_paged
from tandem.runner.kv_cache import (
    STORED_DTYPES,
    cache_rows,
    dequantize_kv_rows,
    quantize_kv_rows,
)

pytestmark = pytest.mark.usefixtures("two_threads")  # (conftest.py)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64


def softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of scores [H, ..., keys]; with ``sinks`` [H], as
    transformers' gpt-oss writes it: each head's sink a last column, dropped after."""
    if sinks is None:
        return scores.softmax(-1)
    column = (
        sinks.to(scores.dtype).view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    )
    return torch.cat([scores, column], -1).softmax(-1)[..., :-1]


def sink_logits(heads: int) -> torch.Tensor:
    """Sinks of every size against the scores: around them, far above (a row of almost
    nothing: exp overflows unless the kernel keeps it apart) and far below."""
    sinks = torch.randn(heads) * 2
    sinks[0], sinks[-1] = 60.0, -60.0
    return sinks


def reference(q, k_ctx, v_ctx, num_computed, window, sinks=None):
    """Attention of the new tokens of one sequence over its whole context, written out."""
    group = HEADS // KV_HEADS
    k_ctx = k_ctx.repeat_interleave(group, dim=1)
    v_ctx = v_ctx.repeat_interleave(group, dim=1)
    out = []
    for i in range(q.shape[0]):
        pos = num_computed + i
        first = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,thd->ht", q[i], k_ctx[first : pos + 1]) / HEAD_DIM**0.5
        out.append(torch.einsum("ht,thd->hd", softmax(scores, sinks), v_ctx[first : pos + 1]))
    return torch.stack(out)


def backend_device(backend: str, kv_dtype: str = "auto") -> torch.device:
    """Where ``backend`` runs in this test session (skips when it cannot run here)."""
    if backend == "cpu-paged" and cpu_kernels.load() is None:
        pytest.skip("no compiler for the CPU kernels here")
    if backend != "triton-paged":
        return torch.device("cpu")
    if triton_paged.triton is None:
        pytest.skip("Triton is not installed")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's interpreter, on the CPU
        if kv_dtype in STORED_DTYPES:
            pytest.skip("Triton's interpreter does not round float32 to bfloat16 / fp8 as GPUs do")
        return torch.device("cpu")
    pytest.skip("no CUDA GPU (TRITON_INTERPRET=1 runs the kernel on the CPU)")


@pytest.mark.parametrize("backend", ["torch-sdpa", "cpu-paged", "triton-paged"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("batch", ["mixed", "mixed-split", "decodes", "decode-arrays", "verify"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "bfloat16", "fp8"])
def test_batch_matches_brute_force(
    backend, window, strided, batch, kv_dtype, monkeypatch, sinks: bool = False
):
    """With an int8 cache, every token read from the cache is its int8 row times its
    scale; with a bfloat16 or fp8 cache, its row rounded to that type (the reference
    reads the same rows), prompts attended without the cache too. "mixed-split": every
    prompt chunk after a cache takes the long-chunk path (the chunk and its prefix's
    spans attended apart, merged by log-sum-exp). "decode-arrays": decodes described
    by arrays as a static batch passes them (ModelRunner.decode_logits), each table row
    padded with other sequences' blocks, never to be read."""
    device = backend_device(backend, kv_dtype)
    if batch == "mixed-split":
        monkeypatch.setattr(torch_sdpa, "SPLIT_MASK_ELEMENTS", 1)
        # Prefixes read in spans of 5 tokens: several per prefix, starting mid-block;
        # chunks' queries 4 rows at a time: a 6-token chunk in two unequal slices.
        monkeypatch.setattr(torch_sdpa, "PREFIX_SPAN", 5)
        monkeypatch.setattr(torch_sdpa, "QUERY_SLICE", 4)
    torch.manual_seed(0)
    # (cached tokens, new tokens): decodes, fresh prompts of equal and unequal length,
    # and chunks continuing after the cache.
    shapes = [(9, 1), (0, 7), (0, 7), (0, 3), (5, 6), (13, 1), (2, 1), (20, 4)]
    if batch in ("decodes", "decode-arrays"):  # one contiguous run: works in place
        shapes = [(9, 1), (13, 1), (2, 1), (30, 1)]
    if batch == "verify":  # decodes with their drafts (several rows each), and a chunk
        shapes = [(9, 4), (13, 1), (2, 3), (30, 5), (5, 6)]
    kv_cache = torch.zeros(1, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if kv_dtype == "int8":
        kv_cache = torch.zeros(
            1, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM + 4, dtype=torch.uint8
        )
    elif kv_dtype in STORED_DTYPES:
        kv_cache = kv_cache.to(STORED_DTYPES[kv_dtype])
    store = quantize_kv_rows if kv_dtype == "int8" else (lambda x: cache_rows(x, kv_cache.dtype))
    pool = torch.randperm(NUM_BLOCKS).tolist()
    tables, contexts = [], []
    for cached, new in shapes:
        count = -(-(cached + new) // BLOCK_SIZE)
        tables.append([pool.pop() for _ in range(count)])
        k_ctx = torch.randn(cached + new, KV_HEADS, HEAD_DIM)
        v_ctx = torch.randn(cached + new, KV_HEADS, HEAD_DIM)
        for pos in range(cached):  # the cached part is already in the blocks
            block, offset = tables[-1][pos // BLOCK_SIZE], pos % BLOCK_SIZE
            kv_cache[0, 0, block, offset] = store(k_ctx[pos])
            kv_cache[0, 1, block, offset] = store(v_ctx[pos])
        contexts.append((k_ctx, v_ctx))
    query_lens = [new for _, new in shapes]
    num_computed = [cached for cached, _ in shapes]
    verifying = [batch == "verify" and new > 1 and cached != 5 for cached, new in shapes]
    described = query_lens, num_computed, tables
    if batch == "decode-arrays":
        width = max(map(len, tables))
        padded = [t + tables[(i + 1) % len(tables)][: width - len(t)] for i, t in enumerate(tables)]
        padded = [t + [pool[0]] * (width - len(t)) for t in padded]
        described = np.array(query_lens), np.array(num_computed), np.array(padded)
    cls = BACKENDS[backend][0]
    metadata = getattr(cls, "build_metadata", build_paged_metadata)(
        *described, BLOCK_SIZE, [window], device, verifying=verifying
    )
    if batch == "verify" and backend != "triton-paged":
        assert metadata.groups[0].decodes and metadata.groups[0].query_index.shape[1] == 5
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM)
    sink = sink_logits(HEADS) if sinks else None
    k = torch.cat([ctx[0][cached:] for ctx, (cached, _) in zip(contexts, shapes, strict=True)])
    v = torch.cat([ctx[1][cached:] for ctx, (cached, _) in zip(contexts, shapes, strict=True)])
    if strided:  # as the model passes them: views into one fused qkv row
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q, k, v = (
            part.view(len(qkv), -1, HEAD_DIM)
            for part in qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], 1)
        )
    attention = cls(metadata, kv_cache.to(device))
    with torch.inference_mode():
        options = {} if sink is None else {"sinks": sink.to(device)}
        out = attention.attend(
            0, q.to(device), k.to(device), v.to(device), HEAD_DIM**-0.5, **options
        )
    out = out.cpu()
    # Every token sees its context as the cache holds it, fresh prompts attended over
    # this forward's own K/V included.
    start = 0
    for (cached, new), (k_ctx, v_ctx) in zip(shapes, contexts, strict=True):
        if kv_dtype == "int8":  # read back from the int8 cache
            k_ctx = dequantize_kv_rows(quantize_kv_rows(k_ctx), torch.float32)
            v_ctx = dequantize_kv_rows(quantize_kv_rows(v_ctx), torch.float32)
        elif kv_dtype in STORED_DTYPES:  # rounded to the cache type
            k_ctx, v_ctx = (cache_rows(x, kv_cache.dtype).float() for x in (k_ctx, v_ctx))
        expected = reference(q[start : start + new], k_ctx, v_ctx, cached, window, sink)
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-5, rtol=1e-5)
        start += new


@pytest.mark.parametrize("backend", ["torch-sdpa", "cpu-paged", "triton-paged"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("batch", ["mixed", "mixed-split", "decodes", "verify"])
def test_sinks_match_brute_force(backend, window, batch, monkeypatch):
    """Attention sinks (gpt-oss: a logit per query head in every row's softmax) on every
    path of every backend: fresh prompts, chunks (masked, or split and merged by
    log-sum-exp), decodes and verification rows."""
    test_batch_matches_brute_force(backend, window, True, batch, "auto", monkeypatch, True)


LONG_HEAD_DIM, LONG_BLOCK = 64, 16


def _cache(kv_dtype: str, num_blocks: int, head_dim: int) -> torch.Tensor:
    width = head_dim + (4 if kv_dtype == "int8" else 0)
    dtype = torch.uint8 if kv_dtype == "int8" else STORED_DTYPES.get(kv_dtype, torch.float32)
    return torch.zeros(2, num_blocks, LONG_BLOCK, KV_HEADS, width, dtype=dtype)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "bfloat16", "fp8"])
@pytest.mark.parametrize("window", [None, 700])
def test_long_contexts_match_brute_force(kv_dtype, window):
    """The decode kernel splits each context into spans merged by their softmax
    statistics (flash-decoding): one sequence of 32k tokens, others ending on, just
    before and just after a span's edge, a verification run crossing one, and a window
    that starts inside a span. Against brute force over the rows read back from the
    cache; and a decode row equals itself bit for bit alone and with draft rows."""
    shapes = [(32768, 1), (256, 1), (255, 1), (257, 1), (3000, 4), (514, 3), (1, 1)]
    _check_decode_kernel(kv_dtype, window, shapes, LONG_HEAD_DIM)


@pytest.mark.parametrize("window", [None, 700])
def test_sinks_over_long_contexts_match_brute_force(window):
    """Sinks where the spans of a context are merged (each sink joins once)."""
    shapes = [(3000, 1), (256, 1), (257, 1), (514, 3), (1, 1)]
    _check_decode_kernel("auto", window, shapes, LONG_HEAD_DIM, sinks=sink_logits(HEADS))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "bfloat16"])
@pytest.mark.parametrize("head_dim", [128, 80])
def test_every_head_size_path_matches_brute_force(kv_dtype, head_dim):
    """The kernel's other compiled head size (128: Llama-3-8B's, Qwen3's) and the
    generic path (80: not one of them), over contexts that end inside, on and past a
    tile of keys, with verification runs: against brute force as above."""
    shapes = [(1, 1), (7, 1), (8, 1), (9, 1), (300, 1), (61, 3), (700, 4)]
    _check_decode_kernel(kv_dtype, 500, shapes, head_dim)


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_wide_query_groups_match_brute_force(kv_dtype):
    """Eight query heads a KV head (Qwen3-30B-A3B's, Llama-3-70B's): the kernel takes a
    KV head's queries in runs that share each row's conversion, and eight split into
    other runs than the groups of three above; against brute force, decode rows bit
    for bit with their verification runs."""
    shapes = [(1, 1), (9, 1), (300, 1), (61, 3), (700, 4)]
    _check_decode_kernel(kv_dtype, None, shapes, LONG_HEAD_DIM, heads=8 * KV_HEADS)


def _check_decode_kernel(
    kv_dtype: str, window: int | None, shapes, head_dim: int, heads: int = HEADS, sinks=None
) -> None:
    """``shapes``: (context length, query rows) per sequence; a row r of a sequence
    sees length - rows + r + 1 tokens; ``heads`` query heads over KV_HEADS."""
    if cpu_kernels.load() is None:
        pytest.skip("no compiler for the CPU kernels here")
    torch.manual_seed(0)
    store = quantize_kv_rows if kv_dtype == "int8" else None
    num_blocks = sum(-(-length // LONG_BLOCK) for length, _ in shapes)
    cache = _cache(kv_dtype, num_blocks, head_dim)
    pool = torch.randperm(num_blocks).tolist()
    width = max(-(-length // LONG_BLOCK) for length, _ in shapes)
    tables = torch.zeros(len(shapes), width, dtype=torch.long)
    contexts, row_lens = [], []
    for s, (length, rows) in enumerate(shapes):
        count = -(-length // LONG_BLOCK)
        tables[s, :count] = torch.tensor([pool.pop() for _ in range(count)])
        kv = torch.randn(2, length, KV_HEADS, head_dim)
        stored = store(kv) if store else cache_rows(kv, cache.dtype)
        positions = torch.arange(length)
        slots = tables[s, positions // LONG_BLOCK] * LONG_BLOCK + positions % LONG_BLOCK
        cache.view(2, -1, KV_HEADS, cache.shape[-1])[:, slots] = stored
        read_back = dequantize_kv_rows(stored, torch.float32) if store else stored.float()
        contexts.append(read_back)
        row_lens += [length - rows + r + 1 for r in range(rows)]
    row_starts = torch.tensor([0, *torch.tensor([r for _, r in shapes]).cumsum(0).tolist()])
    q = torch.randn(len(row_lens), heads, head_dim)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_attention_rows(
        q, cache[0], cache[1], tables, torch.tensor(row_lens), row_starts, scale, window, sinks
    )
    group = heads // KV_HEADS
    for row, length in enumerate(row_lens):
        seq = int(torch.searchsorted(row_starts, row, right=True)) - 1
        first = 0 if window is None else max(0, length - window)
        k_ctx, v_ctx = (x[first:length].repeat_interleave(group, 1) for x in contexts[seq])
        probs = softmax(torch.einsum("hd,thd->ht", q[row].double(), k_ctx.double()) * scale, sinks)
        expected = torch.einsum("ht,thd->hd", probs, v_ctx.double()).float()
        torch.testing.assert_close(out[row], expected, atol=2e-5, rtol=1e-4)
    # A decode alone is the first row of its verification run, to the bit.
    runs = [s for s, (_, rows) in enumerate(shapes) if rows > 1]
    first_rows = row_starts[runs]
    alone = cpu_kernels.decode_attention(
        q[first_rows], cache[0], cache[1], tables[runs], torch.tensor(row_lens)[first_rows],
        scale, window, sinks=sinks,
    )  # fmt: skip
    assert torch.equal(alone, out[first_rows])


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "fp8", "int8"])
@pytest.mark.parametrize("window", [None, 700])
def test_triton_decode_splits_match_brute_force(kv_dtype, window, sinks: bool = False):
    """The Triton kernel splits a small decode batch's keys among programs and merges
    the splits by their softmax statistics (flash-decoding): contexts ending on, before
    and after a split's edge, verification runs (3 rows: a decode's tile; 6 rows x 3
    query heads: the wider prompt tile, split too), a window starting inside a split,
    and a batch too large to split, against brute force over the cache's rows."""
    device = backend_device("triton-paged", kv_dtype)
    torch.manual_seed(0)
    # (context length, query rows): a row r of a sequence sees length - rows + r + 1 tokens
    shapes = [(3000, 1), (256, 1), (255, 1), (257, 1), (514, 3), (1, 1), (700, 6)]
    num_blocks = sum(-(-length // LONG_BLOCK) for length, _ in shapes)
    cache = _cache(kv_dtype, num_blocks, LONG_HEAD_DIM)
    pool = torch.randperm(num_blocks).tolist()
    tables, contexts = [], []
    for length, _ in shapes:
        table = [pool.pop() for _ in range(-(-length // LONG_BLOCK))]
        kv = torch.randn(2, length, KV_HEADS, LONG_HEAD_DIM)
        stored = quantize_kv_rows(kv) if kv_dtype == "int8" else cache_rows(kv, cache.dtype)
        positions = torch.arange(length)
        slots = torch.tensor(table)[positions // LONG_BLOCK] * LONG_BLOCK + positions % LONG_BLOCK
        cache.view(2, -1, KV_HEADS, cache.shape[-1])[:, slots] = stored
        read = dequantize_kv_rows(stored, torch.float32) if kv_dtype == "int8" else stored
        contexts.append(read.float())
        tables.append(table)
    metadata = triton_paged.build_flat_metadata(
        [rows for _, rows in shapes], [length - rows for length, rows in shapes], tables,
        LONG_BLOCK, device=device,
    )  # fmt: skip
    q = torch.randn(metadata.num_tokens, HEADS, LONG_HEAD_DIM)
    sink = sink_logits(HEADS) if sinks else None
    options = {} if sink is None else {"sinks": sink.to(device)}
    scale = LONG_HEAD_DIM**-0.5
    cache = cache.to(device)
    out = triton_paged.paged_attention(
        q.to(device), cache[0], cache[1], metadata, scale, window, **options
    )
    out = out.cpu()
    group, row = HEADS // KV_HEADS, 0
    for (length, rows), (k_all, v_all) in zip(shapes, contexts, strict=True):
        for r in range(rows):
            seen = length - rows + r + 1
            first = 0 if window is None else max(0, seen - window)
            k_ctx, v_ctx = (x[first:seen].repeat_interleave(group, 1) for x in (k_all, v_all))
            scores = torch.einsum("hd,thd->ht", q[row].double(), k_ctx.double()) * scale
            expected = torch.einsum("ht,thd->hd", softmax(scores, sink), v_ctx.double()).float()
            torch.testing.assert_close(out[row], expected, atol=2e-5, rtol=1e-4)
            row += 1
    # Split or not, the result is the same function: one split per sequence.
    saved = triton_paged.SPLIT_BELOW_PROGRAMS
    try:
        triton_paged.SPLIT_BELOW_PROGRAMS = 0
        whole = triton_paged.paged_attention(
            q.to(device), cache[0], cache[1], metadata, scale, window, **options
        ).cpu()
    finally:
        triton_paged.SPLIT_BELOW_PROGRAMS = saved
    torch.testing.assert_close(whole, out, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 700])
def test_triton_decode_splits_with_sinks_match_brute_force(window):
    """Each sink joins a split decode's merged sums once."""
    test_triton_decode_splits_match_brute_force("auto", window, True)


@pytest.mark.parametrize("query_slice", [512, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks", [False, True])
def test_long_chunk_after_a_long_prefix_matches_brute_force(dtype, query_slice, sinks, monkeypatch):
    """A 512-token chunk after 2,600 cached tokens (over SPLIT_MASK_ELEMENTS: no mask
    is built), its prefix given in three spans, equals attention written out over the
    whole context: its queries in one slice, or in slices of 200, 200 and 112 rows
    (each also over the chunk's rows before it)."""
    monkeypatch.setattr(torch_sdpa, "QUERY_SLICE", query_slice)
    torch.manual_seed(0)
    cached, new, heads, kv_heads, head_dim = 2600, 512, 12, 4, 32
    assert heads // kv_heads * new * (cached + new) >= torch_sdpa.SPLIT_MASK_ELEMENTS
    q = torch.randn(new, heads, head_dim, dtype=dtype)
    k, v = torch.randn(2, cached + new, kv_heads, head_dim, dtype=dtype)
    # The prefix in spans of any size and order, as the blocks are read.
    bounds = [(1000, 2600), (0, 7), (7, 1000)]
    spans = [(k[a:b], v[a:b]) for a, b in bounds]
    sink = sink_logits(heads) if sinks else None
    out = torch_sdpa.split_chunk_attention(q, k[cached:], v[cached:], spans, head_dim**-0.5, sink)
    keys, values = (x.double().repeat_interleave(heads // kv_heads, 1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * head_dim**-0.5
    causal = torch.arange(cached + new)[None, :] <= cached + torch.arange(new)[:, None]
    probs = softmax(scores.masked_fill(~causal, float("-inf")), sink)
    expected = torch.einsum("hqk,khd->qhd", probs, values)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


GRAPH_STEPS = {  # (cached tokens, tokens this step) of each sequence
    "decodes": [(9, 1), (13, 1), (2, 1), (30, 1), (0, 1)],
    "verify": [(9, 4), (13, 1), (2, 3), (30, 5), (5, 2)],
}


def _graph_step(kind: str, batch: int, width: int, device: torch.device | None = None):
    """A step's eager flat metadata and its CUDA graph's host inputs (cuda_graphs.py:
    ``batch`` sequences of the step's most tokens each, tables ``width`` wide)."""
    shapes = GRAPH_STEPS[kind]
    pool = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [[pool.pop() for _ in range(-(-(c + q) // BLOCK_SIZE))] for c, q in shapes]
    token_ids = [
        [random.Random(i).randrange(1000) for _ in range(q)] for i, (_, q) in enumerate(shapes)
    ]
    num_computed = [c for c, _ in shapes]
    rows = max(q for _, q in shapes)
    size = 3 * batch * rows + 2 * batch + 1 + batch * width
    parts = cuda_graphs._split(np.full(size, 999, np.int64), batch, rows, width)
    count = cuda_graphs.fill_step_inputs(parts, token_ids, num_computed, tables, BLOCK_SIZE)
    eager = triton_paged.build_flat_metadata(
        [q for _, q in shapes], num_computed, tables, BLOCK_SIZE, device=device or "cpu"
    )
    return shapes, token_ids, tables, parts, count, eager


@pytest.mark.parametrize("layout", ["loop", "numpy"])
@pytest.mark.parametrize("kind", GRAPH_STEPS)
def test_graph_inputs_lay_out_the_eager_step(kind, layout, monkeypatch):
    """A graph's inputs hold the eager metadata's positions, slots, query starts,
    cached counts and every table entry a query can read, in the first rows; padding
    tokens write no K/V and belong to no sequence, padding sequences have no queries
    (laid out by the few sequences' loop or by numpy)."""
    monkeypatch.setattr(cuda_graphs, "NUMPY_FROM", 1 if layout == "numpy" else 1000)
    shapes, token_ids, tables, parts, count, eager = _graph_step(kind, batch=8, width=16)
    ids, positions, slots, starts, computed, graph_tables = parts
    n = len(shapes)
    assert count == eager.num_tokens == sum(q for _, q in shapes)
    assert ids[:count].tolist() == [t for tokens in token_ids for t in tokens]
    assert np.array_equal(positions[:count], eager.positions.numpy())
    assert np.array_equal(slots[:count], eager.slot_mapping.numpy())
    assert np.array_equal(starts[: n + 1], eager.query_starts.numpy())
    assert np.array_equal(computed[:n], eager.num_computed.numpy())
    for i, (cached, new) in enumerate(shapes):
        used = -(-(cached + new) // BLOCK_SIZE)
        assert graph_tables[i, :used].tolist() == tables[i]
        assert set(graph_tables[i, used:].tolist()) <= {tables[i][-1]}
    assert (slots[count:] == -1).all() and (ids[count:] == 0).all()
    assert (starts[n:] == count).all() and (computed[n:] == 0).all()
    assert (graph_tables[n:] == 0).all()


@pytest.mark.parametrize("kind", GRAPH_STEPS)
def test_triton_graph_inputs_attend_as_the_eager_step(kind):
    """The Triton kernel over a graph's padded inputs (as a replay runs it) gives the
    eager step's rows and writes the same K/V, nothing for the padding."""
    device = backend_device("triton-paged")
    batch, width = 8, 16
    shapes, _, _, parts, count, eager = _graph_step(kind, batch, width, device)
    rows = max(q for _, q in shapes)
    positions, slots, starts, computed, tables = (torch.from_numpy(p).to(device) for p in parts[1:])
    padded = triton_paged.FlatMetadata(
        positions=positions, slot_mapping=slots, query_starts=starts, num_computed=computed,
        block_tables=tables, num_seqs=batch, max_query_len=rows,
        layer_windows=eager.layer_windows, num_tokens=batch * rows,
    )  # fmt: skip
    torch.manual_seed(0)
    cache = torch.randn(1, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    q, k, v = (torch.randn(batch * rows, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    results = []
    for metadata, tokens in ((eager, count), (padded, batch * rows)):
        kv = cache.clone().to(device)
        attention = triton_paged.TritonPagedAttention(metadata, kv)
        with torch.inference_mode():
            out = attention.attend(0, *(x[:tokens].to(device) for x in (q, k, v)), HEAD_DIM**-0.5)
        results.append((out[:count].cpu(), kv.cpu()))
    (eager_out, eager_kv), (graph_out, graph_kv) = results
    torch.testing.assert_close(graph_out, eager_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(graph_kv, eager_kv)
