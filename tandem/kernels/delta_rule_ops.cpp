// The gated delta rule's decode step (kernels/delta_rule.py has the definitions): one
// token for each of B sequences, each head's state [Dk, Dv] updated in place in its
// slot of the state cache, read twice and written once (torch's ops pass over it six
// times: gather, decay, two products, update, scatter).
//
// With a = exp(g), kS = S^T k and qS = S^T q of the state before the token:
//   delta = beta (v - a kS)        S' = a S + k delta^T        o = S'^T q = a qS + (q.k) delta
// so one read pass makes kS and qS, and one pass writes S'.

#include <torch/python.h>

#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

namespace {

// One head's token: ``o`` = S'^T q, and S [dk, dv] updated in place to S'. ``ks``, ``qs``
// are dv floats of scratch; ``delta`` receives the rule's correction (dv floats).
inline void delta_rule_token(float* S, const float* q, const float* k, const float* v,
                             float a, float rate, int64_t dk, int64_t dv, float* ks,
                             float* qs, float* delta, float* o) {
  std::fill(ks, ks + dv, 0.f);
  std::fill(qs, qs + dv, 0.f);
  float qk = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = S + i * dv;
    const float kv = k[i], qv = q[i];
    qk += kv * qv;
    for (int64_t j = 0; j < dv; ++j) {
      ks[j] += kv * row[j];
      qs[j] += qv * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) {
    delta[j] = rate * (v[j] - a * ks[j]);
    o[j] = a * qs[j] + qk * delta[j];
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const float kv = k[i];
    for (int64_t j = 0; j < dv; ++j) row[j] = a * row[j] + kv * delta[j];
  }
}

// The B sequences' slots, each checked against the cache's ``num_slots``.
const int64_t* checked_slots(const torch::Tensor& slots, int64_t batch, int64_t num_slots) {
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "state slot out of range");
  }
  return slot;
}

}  // namespace

void gated_delta_step(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                      torch::Tensor g, torch::Tensor beta, torch::Tensor states,
                      torch::Tensor slots) {
  for (auto* t : {&out, &q, &k, &v, &g, &beta, &states}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "gated_delta_step takes contiguous float32 tensors");
  }
  const int64_t batch = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(states.size(1) == heads && states.size(2) == dk && states.size(3) == dv);
  const int64_t* slot = checked_slots(slots, batch, states.size(0));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = states.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ks(dv), qs(dv), delta(dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, h = item % heads;
      delta_rule_token(sp + (slot[b] * heads + h) * dk * dv, qp + item * dk, kp + item * dk,
                       vp + item * dv, std::exp(gp[item]), bp[item], dk, dv, ks.data(),
                       qs.data(), delta.data(), op + item * dv);
    }
  });
}

// A Gated DeltaNet layer's decode step after its input projection, for B sequences:
// the causal conv on its window (in the slot, shifted in place), silu, q and k
// L2-normalized (q scaled by Dk^-0.5), beta = sigmoid(b), g = A * softplus(a + dt_bias),
// the delta rule in the slot, and the gated RMSNorm: out = norm(o) * w * silu(z).
// models/gated_delta_net.py has the same in torch. ``tiled``: value head j reads key
// head j % Hk (llama.cpp's order), else j / (Hv / Hk). All float32, contiguous:
// qkv [B, C], z [B, Hv * Dv], b and a [B, Hv], conv_w [C, W], conv_states [N, C, W - 1],
// A, dt_bias [Hv], norm_w [Dv], states [N, Hv, Dk, Dv]; out [B, Hv * Dv].
void gated_delta_net_step(torch::Tensor out, torch::Tensor qkv, torch::Tensor z,
                          torch::Tensor b, torch::Tensor a, torch::Tensor conv_w,
                          torch::Tensor conv_states, torch::Tensor A, torch::Tensor dt_bias,
                          torch::Tensor norm_w, torch::Tensor states, torch::Tensor slots,
                          int64_t key_heads, bool tiled, double eps) {
  for (auto* t : {&out, &qkv, &z, &b, &a, &conv_w, &conv_states, &A, &dt_bias, &norm_w,
                  &states}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "gated_delta_net_step takes contiguous float32 tensors");
  }
  const int64_t batch = qkv.size(0), channels = qkv.size(1), width = conv_w.size(1);
  const int64_t heads = states.size(1), dk = states.size(2), dv = states.size(3);
  const int64_t num_slots = states.size(0);
  TORCH_CHECK(channels == 2 * key_heads * dk + heads * dv && heads % key_heads == 0);
  TORCH_CHECK(conv_states.size(0) == num_slots && conv_states.size(1) == channels &&
              conv_states.size(2) == width - 1);
  const int64_t* slot = checked_slots(slots, batch, num_slots);
  // Phase 1, per (sequence, channel run): the conv and silu into ``mixed``.
  std::vector<float> mixed(batch * channels);
  const float* x = qkv.data_ptr<float>();
  const float* w = conv_w.data_ptr<float>();
  float* cs = conv_states.data_ptr<float>();
  const int64_t kept = width - 1;
  at::parallel_for(0, batch * channels, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / channels, c = item % channels;
      float* window = cs + (slot[s] * channels + c) * kept;
      const float* taps = w + c * width;
      const float now = x[item];
      float y = taps[kept] * now;
      for (int64_t j = 0; j < kept; ++j) y += taps[j] * window[j];
      for (int64_t j = 0; j + 1 < kept; ++j) window[j] = window[j + 1];
      if (kept > 0) window[kept - 1] = now;
      mixed[item] = y / (1.f + std::exp(-y));
    }
  });
  // Phase 2, per (sequence, key head): q and k normalized in place.
  const float scale = 1.f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, batch * key_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / key_heads, h = item % key_heads;
      for (int64_t part = 0; part < 2; ++part) {
        float* v = mixed.data() + s * channels + (part * key_heads + h) * dk;
        float sum = 0.f;
        for (int64_t i = 0; i < dk; ++i) sum += v[i] * v[i];
        const float inv = 1.f / std::sqrt(sum + 1e-6f) * (part == 0 ? scale : 1.f);
        for (int64_t i = 0; i < dk; ++i) v[i] *= inv;
      }
    }
  });
  // Phase 3, per (sequence, value head): the delta rule in the slot, then the gated norm.
  const float *zp = z.data_ptr<float>(), *bp = b.data_ptr<float>(), *ap = a.data_ptr<float>();
  const float *Ap = A.data_ptr<float>(), *dtp = dt_bias.data_ptr<float>();
  const float* nw = norm_w.data_ptr<float>();
  float *sp = states.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t per_key = heads / key_heads;
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ks(dv), qs(dv), delta(dv), o(dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / heads, h = item % heads;
      const int64_t kh = tiled ? h % key_heads : h / per_key;
      const float* row = mixed.data() + s * channels;
      const float* qi = row + kh * dk;
      const float* ki = row + (key_heads + kh) * dk;
      const float* vi = row + 2 * key_heads * dk + h * dv;
      const float rate = 1.f / (1.f + std::exp(-bp[item]));
      const float pre = ap[item] + dtp[h];
      const float softplus = pre > 20.f ? pre : std::log1p(std::exp(pre));
      const float decay = std::exp(Ap[h] * softplus);
      delta_rule_token(sp + (slot[s] * heads + h) * dk * dv, qi, ki, vi, decay, rate, dk, dv,
                       ks.data(), qs.data(), delta.data(), o.data());
      float sum = 0.f;
      for (int64_t j = 0; j < dv; ++j) sum += o[j] * o[j];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dv) + static_cast<float>(eps));
      const float* zi = zp + item * dv;
      float* oi = op + item * dv;
      for (int64_t j = 0; j < dv; ++j) {
        oi[j] = nw[j] * (o[j] * inv) * (zi[j] / (1.f + std::exp(-zi[j])));
      }
    }
  });
}
