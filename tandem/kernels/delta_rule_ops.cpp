// The gated delta rule's decode step (kernels/delta_rule.py has the definitions): one
// token for each of B sequences, each head's state [Dk, Dv] updated in place in its
// slot of the state cache, read twice and written once (torch's ops pass over it six
// times: gather, decay, two products, update, scatter).
//
// With a = exp(g), kS = S^T k and qS = S^T q of the state before the token:
//   delta = beta (v - a kS)        S' = a S + k delta^T        o = S'^T q = a qS + (q.k) delta
// so one read pass makes kS and qS, and one pass writes S'.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

void gated_delta_step(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                      torch::Tensor g, torch::Tensor beta, torch::Tensor states,
                      torch::Tensor slots) {
  for (auto* t : {&out, &q, &k, &v, &g, &beta, &states}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "gated_delta_step takes contiguous float32 tensors");
  }
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous());
  const int64_t batch = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(states.size(1) == heads && states.size(2) == dk && states.size(3) == dv);
  const int64_t num_slots = states.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "state slot out of range");
  }
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = states.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ks(dv), qs(dv), delta(dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, h = item % heads;
      float* S = sp + (slot[b] * heads + h) * dk * dv;
      const float* qi = qp + item * dk;
      const float* ki = kp + item * dk;
      const float* vi = vp + item * dv;
      const float a = std::exp(gp[item]), rate = bp[item];
      std::fill(ks.begin(), ks.end(), 0.f);
      std::fill(qs.begin(), qs.end(), 0.f);
      float qk = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        const float* row = S + i * dv;
        const float kv = ki[i], qv = qi[i];
        qk += kv * qv;
        for (int64_t j = 0; j < dv; ++j) {
          ks[j] += kv * row[j];
          qs[j] += qv * row[j];
        }
      }
      float* o = op + item * dv;
      for (int64_t j = 0; j < dv; ++j) {
        delta[j] = rate * (vi[j] - a * ks[j]);
        o[j] = a * qs[j] + qk * delta[j];
      }
      for (int64_t i = 0; i < dk; ++i) {
        float* row = S + i * dv;
        const float kv = ki[i];
        for (int64_t j = 0; j < dv; ++j) row[j] = a * row[j] + kv * delta[j];
      }
    }
  });
}
