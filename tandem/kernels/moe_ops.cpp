// A mixture-of-experts layer's experts in one call, from the router's logits on:
// runner/linear/experts.py's steps made from C++ (the softmax, top-k and
// renormalization as ATen ops, the projections by quant_linear_many, the activation
// by cpu_ops.cpp's kernel), so the result is that Python path's bit for bit; what
// it saves is the Python and dispatch between them (about 0.3 ms a layer on 2 cores,
// a fifth of a 30B-A3B decode step).
//
// The experts' matrices come as lists, one entry per expert of the layer, in
// quant_linear's packed layout; an empty corr tensor means none.

// out [T, hidden] and the tokens each expert took [experts] (int64).
std::vector<torch::Tensor> moe_experts(
    torch::Tensor x, torch::Tensor logits, int64_t top_k, bool normalize,
    std::vector<torch::Tensor> gu_values, std::vector<torch::Tensor> gu_scales,
    std::vector<torch::Tensor> gu_corrs, int64_t gu_rows, int64_t gu_group, double gu_offset,
    std::vector<torch::Tensor> dn_values, std::vector<torch::Tensor> dn_scales,
    std::vector<torch::Tensor> dn_corrs, int64_t dn_rows, int64_t dn_group, double dn_offset,
    bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat,
              "x: float32 [T, hidden], contiguous");
  const int64_t T = x.size(0), H = x.size(1), E = logits.size(1);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == T, "logits: [T, experts]");
  TORCH_CHECK(static_cast<int64_t>(gu_values.size()) == E && static_cast<int64_t>(dn_values.size()) == E,
              "one gate/up and one down matrix per expert");
  TORCH_CHECK(dn_rows == H && gu_rows % 2 == 0, "down gives hidden rows; gate/up two halves");
  torch::Tensor probs = torch::softmax(logits, -1, torch::kFloat);
  auto picked = torch::topk(probs, top_k, -1);
  torch::Tensor weights = std::get<0>(picked), chosen = std::get<1>(picked).contiguous();
  if (normalize) weights = weights / weights.sum(-1, true);
  weights = weights.to(x.scalar_type()).contiguous();
  // The (token, pick) slots sorted by expert, a stable order: a token's picks in turn.
  const int64_t* ids = chosen.data_ptr<int64_t>();
  torch::Tensor counts = torch::zeros({E}, torch::kLong);
  int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t s = 0; s < T * top_k; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < E, "expert id out of range");
    ++count[ids[s]];
  }
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + count[e];
  std::vector<int64_t> order(T * top_k);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < T * top_k; ++s) order[next[ids[s]]++] = s;
  }
  const int64_t S = T * top_k;
  torch::Tensor rows = torch::empty({S, H}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = rows.data_ptr<float>();
  for (int64_t i = 0; i < S; ++i) std::memcpy(dst + i * H, src + (order[i] / top_k) * H, H * sizeof(float));
  // Each picked expert's rows through its gate/up, then its down (one call each).
  std::vector<int64_t> experts;
  for (int64_t e = 0; e < E; ++e)
    if (count[e]) experts.push_back(e);
  auto project = [&](const torch::Tensor& in, torch::Tensor& out, const std::vector<torch::Tensor>& values,
                     const std::vector<torch::Tensor>& scales, const std::vector<torch::Tensor>& corrs,
                     int64_t N, int64_t group, double offset) {
    std::vector<torch::Tensor> outs, xs, vs, ss, cs;
    for (int64_t e : experts) {
      outs.push_back(out.narrow(0, start[e], count[e]));
      xs.push_back(in.narrow(0, start[e], count[e]));
      vs.push_back(values[e]);
      ss.push_back(scales[e]);
      cs.push_back(corrs[e]);
    }
    quant_linear_many(outs, xs, vs, ss, cs, N, group, offset);
  };
  torch::Tensor gate_up = torch::empty({S, gu_rows}, x.options());
  project(rows, gate_up, gu_values, gu_scales, gu_corrs, gu_rows, gu_group, gu_offset);
  torch::Tensor acted = torch::empty({S, gu_rows / 2}, x.options());
  if (gelu) gelu_tanh_and_mul(acted, gate_up); else silu_and_mul(acted, gate_up);
  torch::Tensor down = torch::empty({S, H}, x.options());
  project(acted, down, dn_values, dn_scales, dn_corrs, dn_rows, dn_group, dn_offset);
  // Each row times its routing weight, then added into its token's row in slot order
  // (two passes, as the Python path's mul_ and index_add_).
  const float* w = weights.data_ptr<float>();
  float* d = down.data_ptr<float>();
  for (int64_t i = 0; i < S; ++i) {
    const float scale = w[order[i]];
    for (int64_t h = 0; h < H; ++h) d[i * H + h] *= scale;
  }
  torch::Tensor out = torch::zeros({T, H}, x.options());
  out.index_add_(0, torch::from_blob(order.data(), {S}, torch::kLong).div(top_k, "floor"), down);
  return {out, counts};
}
