"""A CPU paged-attention kernel for decode, compiled on first use.

The torch path gathers each sequence's K/V blocks into a padded tensor and then runs
scaled_dot_product_attention over it: every K/V byte crosses memory three times
(read, write, read again) and short sequences pay for the longest one's padding. At
long contexts that traffic rivals the weights themselves. This kernel reads K/V once,
straight from the blocks through the block table, for one query token per sequence:

    for each (sequence, KV head)  (in parallel):
        for each context token t: load K[t] once, score it against the G query heads
                                  that share this KV head
        softmax over the scores (in float32)
        for each context token t: load V[t] once, accumulate into the G outputs

It is built with torch.utils.cpp_extension (gcc and ninja) the first time it is
needed and cached by torch. If building fails (no compiler), or TANDEM_CPU_KERNELS=0,
``load`` returns None and the torch path is used; both are checked against each other
in the tests.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// Visit context positions [first, len) block by block: fn(pos, row offset of the token).
template <typename Fn>
inline void for_each_token(const int64_t* table, int64_t first, int64_t len,
                           int64_t block_size, int64_t row, Fn fn) {
  for (int64_t pos = first; pos < len;) {
    const int64_t block = pos / block_size, offset = pos % block_size;
    const int64_t stop = std::min(len, pos + block_size - offset);
    int64_t base = (table[block] * block_size + offset) * row;
    for (; pos < stop; ++pos, base += row) fn(pos, base);
  }
}

template <typename T>
void decode_attention_impl(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                           torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, int64_t window) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = block_tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t row = num_kv_heads * head_dim;  // one token of one block, all KV heads

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t head_offset = kv_head * head_dim;
      const int64_t* table = tables + seq * table_width;
      scores.resize(group * n);
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = q_ptr + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] = static_cast<float>(qh[d]) * scale;
      }
      // Scores: each key row is loaded once for the whole group of query heads.
      for_each_token(table, first, len, block_size, row, [&](int64_t pos, int64_t base) {
        const T* key = k_ptr + base + head_offset;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query.data() + g * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(key[d]);
          scores[g * n + pos - first] = dot;
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        const float top = *std::max_element(s, s + n);
        float total = 0.f;
        for (int64_t t = 0; t < n; ++t) { s[t] = std::exp(s[t] - top); total += s[t]; }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_token(table, first, len, block_size, row, [&](int64_t pos, int64_t base) {
        const T* value = v_ptr + base + head_offset;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + pos - first];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(value[d]);
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        T* o = out_ptr + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor block_tables,
                      torch::Tensor context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous());
  if (q.scalar_type() == torch::kFloat) {
    decode_attention_impl<float>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_attention_impl<at::BFloat16>(out, q, k_cache, v_cache, block_tables, context_lens, scale, window);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only");
  }
}
"""


def _cpu_tag() -> str:
    """The build uses -march=native, so the cached module is keyed on the CPU's flags:
    a cache carried to another machine is never loaded there."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


@functools.cache
def load():
    """The compiled module, or None when it cannot (or should not) be built."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        name = f"tandem_cpu_paged_attention_{_cpu_tag()}"
        if not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file():
            print(
                "tandem: compiling the CPU paged-attention kernel (first use only, about a "
                "minute; TANDEM_CPU_KERNELS=0 skips it)",
                file=sys.stderr,
            )
        return load_inline(
            name=name,
            cpp_sources=SOURCE,
            functions=["decode_attention"],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, no headers: the torch path works
        logger.warning("CPU paged-attention kernel unavailable, using torch ops: %s", exc)
        return None


def decode_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [S, H, D] (one token per sequence), k/v blocks [num_blocks, block_size, Hkv, D]
    -> [S, H, D]. Requires ``load()`` to have returned the module."""
    out = torch.empty_like(q)
    load().decode_attention(
        out,
        q.contiguous(),
        k_blocks,
        v_blocks,
        block_tables,
        context_lens,
        scale,
        sliding_window or 0,
    )
    return out
