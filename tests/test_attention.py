"""Paged attention paths against brute-force attention over each sequence's context."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.runner.attention import BACKENDS, build_paged_metadata
from tandem.runner.kv_cache import (
    STORED_DTYPES,
    cache_rows,
    dequantize_kv_rows,
    quantize_kv_rows,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64


def reference(q, k_ctx, v_ctx, num_computed, window):
    """Attention of the new tokens of one sequence over its whole context, written out."""
    group = HEADS // KV_HEADS
    k_ctx = k_ctx.repeat_interleave(group, dim=1)
    v_ctx = v_ctx.repeat_interleave(group, dim=1)
    out = []
    for i in range(q.shape[0]):
        pos = num_computed + i
        first = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,thd->ht", q[i], k_ctx[first : pos + 1]) / HEAD_DIM**0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v_ctx[first : pos + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["torch-sdpa", "cpu-paged"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("batch", ["mixed", "decodes", "verify"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "bfloat16", "fp8"])
def test_batch_matches_brute_force(backend, window, strided, batch, kv_dtype):
    """With an int8 cache, every token read from the cache is its int8 row times its
    scale; with a bfloat16 or fp8 cache, its row rounded to that type (the reference
    reads the same rows); prompts the backend attends without the cache see their K/V
    as computed."""
    if backend == "cpu-paged" and cpu_kernels.load() is None:
        pytest.skip("no compiler for the CPU kernels here")
    torch.manual_seed(0)
    # (cached tokens, new tokens): decodes, fresh prompts of equal and unequal length,
    # and chunks continuing after the cache.
    shapes = [(9, 1), (0, 7), (0, 7), (0, 3), (5, 6), (13, 1), (2, 1), (20, 4)]
    if batch == "decodes":  # one contiguous run: the kernel works in place
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
    metadata = build_paged_metadata(
        query_lens, num_computed, tables, BLOCK_SIZE, [window], verifying=verifying
    )
    if batch == "verify":
        assert metadata.groups[0].decodes and metadata.groups[0].query_index.shape[1] == 5
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM)
    k = torch.cat([ctx[0][cached:] for ctx, (cached, _) in zip(contexts, shapes, strict=True)])
    v = torch.cat([ctx[1][cached:] for ctx, (cached, _) in zip(contexts, shapes, strict=True)])
    if strided:  # as the model passes them: views into one fused qkv row
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q, k, v = (
            part.view(len(qkv), -1, HEAD_DIM)
            for part in qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], 1)
        )
    attention = BACKENDS[backend][0](metadata, kv_cache)
    with torch.inference_mode():
        out = attention.attend(0, q, k, v, HEAD_DIM**-0.5)
    # Prompts the backend attends without the cache (the torch path's equal-length
    # fresh prompts), by their first token.
    fresh = {int(i) for g in metadata.fresh_prompts for i in g.token_index[:, 0]}
    start = 0
    for (cached, new), (k_ctx, v_ctx) in zip(shapes, contexts, strict=True):
        if kv_dtype == "int8" and start not in fresh:  # read back from the int8 cache
            k_ctx = dequantize_kv_rows(quantize_kv_rows(k_ctx), torch.float32)
            v_ctx = dequantize_kv_rows(quantize_kv_rows(v_ctx), torch.float32)
        elif kv_dtype in STORED_DTYPES and start not in fresh:  # rounded to the cache type
            k_ctx, v_ctx = (cache_rows(x, kv_cache.dtype).float() for x in (k_ctx, v_ctx))
        expected = reference(q[start : start + new], k_ctx, v_ctx, cached, window)
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-5, rtol=1e-5)
        start += new
