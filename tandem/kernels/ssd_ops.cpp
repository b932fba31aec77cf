// A Mamba-2 mixer's decode step after its input projection (models/mamba2.py has the
// definition; kernels/ssd.py the recurrence): one token for each of B sequences, each
// head's state [N, P] read and written once in place in its slot (torch's ops pass over
// it six times: gather, decay, outer product, add, scatter, and the read for y).
//
// After delta_rule_ops.cpp (checked_slots) in the one translation unit (kernels/cpu.py).

#include <torch/python.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// zxbcdt [B, inner + C + H] (in_proj's output: z, x B C, dt), conv_w [C, W], conv_b [C] or
// empty, conv_states [slots, C, W - 1], dt_bias / A / D [H], norm_w [inner], states
// [slots, H, N, P]: all float32, contiguous. out [B, inner] receives the gated, grouped
// RMSNorm of y = SSD + D x: per group of inner / groups channels,
// norm(y * silu(z)) * norm_w. B and C of group g serve heads [g H / G, (g + 1) H / G).
void mamba2_step(torch::Tensor out, torch::Tensor zxbcdt, torch::Tensor conv_w,
                 torch::Tensor conv_b, torch::Tensor conv_states, torch::Tensor dt_bias,
                 torch::Tensor A, torch::Tensor D, torch::Tensor norm_w, torch::Tensor states,
                 torch::Tensor slots, int64_t groups, double dt_min, double dt_max, double eps) {
  for (auto* t : {&out, &zxbcdt, &conv_w, &conv_states, &dt_bias, &A, &D, &norm_w, &states}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "mamba2_step takes contiguous float32 tensors");
  }
  const int64_t batch = zxbcdt.size(0), channels = conv_w.size(0), width = conv_w.size(1);
  const int64_t heads = states.size(1), n = states.size(2), p = states.size(3);
  const int64_t inner = heads * p, kept = width - 1, num_slots = states.size(0);
  TORCH_CHECK(zxbcdt.size(1) == inner + channels + heads && channels == inner + 2 * groups * n);
  TORCH_CHECK(heads % groups == 0 && out.size(0) == batch && out.size(1) == inner);
  TORCH_CHECK(conv_states.size(0) == num_slots && conv_states.size(1) == channels &&
              conv_states.size(2) == kept);
  const bool biased = conv_b.numel() > 0;
  TORCH_CHECK(!biased || (conv_b.numel() == channels && conv_b.scalar_type() == torch::kFloat32));
  const int64_t* slot = checked_slots(slots, batch, num_slots);
  const int64_t row = inner + channels + heads;
  const float *in = zxbcdt.data_ptr<float>(), *w = conv_w.data_ptr<float>();
  const float* cb = biased ? conv_b.data_ptr<float>() : nullptr;
  float* cs = conv_states.data_ptr<float>();
  // Phase 1, per (sequence, channel): the conv on its window (shifted in place), silu.
  std::vector<float> mixed(batch * channels);
  at::parallel_for(0, batch * channels, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / channels, c = item % channels;
      float* window = cs + (slot[s] * channels + c) * kept;
      const float* taps = w + c * width;
      const float now = in[s * row + inner + c];
      float y = taps[kept] * now;
      for (int64_t j = 0; j < kept; ++j) y += taps[j] * window[j];
      for (int64_t j = 0; j + 1 < kept; ++j) window[j] = window[j + 1];
      if (kept > 0) window[kept - 1] = now;
      if (biased) y += cb[c];
      mixed[item] = y / (1.f + std::exp(-y));
    }
  });
  // Phase 2, per (sequence, head): dt, the state's one pass (decay, add B (dt x)^T,
  // y += S^T C), and the D skip.
  const float *dtb = dt_bias.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float* Dp = D.data_ptr<float>();
  float* sp = states.data_ptr<float>();
  std::vector<float> y(batch * inner);
  const int64_t per_group = heads / groups;
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> dtx(p);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / heads, h = item % heads, g = h / per_group;
      const float* m = mixed.data() + s * channels;
      const float* x = m + h * p;
      const float* Bg = m + inner + g * n;
      const float* Cg = m + inner + groups * n + g * n;
      const float pre = in[s * row + inner + channels + h] + dtb[h];
      float dt = pre > 20.f ? pre : std::log1p(std::exp(pre));
      dt = std::min(std::max(dt, static_cast<float>(dt_min)), static_cast<float>(dt_max));
      const float a = std::exp(dt * Ap[h]);
      for (int64_t j = 0; j < p; ++j) dtx[j] = dt * x[j];
      float* yh = y.data() + s * inner + h * p;
      for (int64_t j = 0; j < p; ++j) yh[j] = Dp[h] * x[j];
      float* S = sp + (slot[s] * heads + h) * n * p;
      for (int64_t i = 0; i < n; ++i) {
        float* Srow = S + i * p;
        const float bi = Bg[i], ci = Cg[i];
        for (int64_t j = 0; j < p; ++j) {
          const float v = a * Srow[j] + bi * dtx[j];
          Srow[j] = v;
          yh[j] += v * ci;
        }
      }
    }
  });
  // Phase 3, per (sequence, group): y * silu(z), RMS-normed over the group, times w.
  const float* nw = norm_w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t size = inner / groups;
  at::parallel_for(0, batch * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / groups, g = item % groups;
      const float* z = in + s * row + g * size;
      const float* yg = y.data() + s * inner + g * size;
      float* og = op + s * inner + g * size;
      float sum = 0.f;
      for (int64_t j = 0; j < size; ++j) {
        const float gated = yg[j] * (z[j] / (1.f + std::exp(-z[j])));
        og[j] = gated;
        sum += gated * gated;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(size) + static_cast<float>(eps));
      for (int64_t j = 0; j < size; ++j) og[j] = nw[g * size + j] * (og[j] * inv);
    }
  });
}
