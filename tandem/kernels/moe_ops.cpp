// A mixture-of-experts layer's experts in one call, from the router's logits on:
// runner/linear/experts.py's steps made from C++ (the routing by moe_route below, the
// projections by quant_ops.cpp's run_many, the activation by cpu_ops.cpp's kernel),
// so the result is the per-expert loop's (models/moe.py, which routes with moe_route
// too) bit for bit; what it saves is the Python and dispatch between them (about 0.3
// ms a layer on 2 cores, a fifth of a 30B-A3B decode step).
//
// Each projection's experts come as one example matrix in quant_linear's packed
// layout (values, scales, corr: empty for none; every expert of the projection is
// laid out like it) and ``where`` [held, 3], int64: the addresses of the values,
// scales and corr (0 for none) of each expert this process holds, experts
// ``first_expert`` .. + held of the router's (a tensor-parallel rank holds every
// expert's share of columns, or a run of whole experts: models/sharding.py), as
// quant::many_matrices describes. The router's picks of other experts are left out:
// the output is this process's part of the sum.

namespace moe {

// The router's picks for token rows [T, E] of float32 logits: the softmax in float32
// (the row's maximum taken off, exp, the sum, each divided by it), the top_k largest
// probabilities in descending order (the lower expert first among equal ones), and,
// with ``normalize``, those k divided by their sum (added in that order). Row by row in
// plain loops: a row's picks do not depend on the rows beside it. Written here rather
// than as ATen ops (softmax, topk, sum, div, to: about 50 us a 30B-A3B layer on a
// 2-core VM, right after its kernels) and used by both the fused call and the
// per-expert loop, so the two agree bit for bit.
void route(const float* logits, int64_t T, int64_t E, int64_t top_k, bool normalize,
           float* weights, int64_t* ids) {
  std::vector<float> probs(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits + t * E;
    float top = row[0];
    for (int64_t e = 1; e < E; ++e) top = std::max(top, row[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      probs[e] = std::exp(row[e] - top);
      sum += probs[e];
    }
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    float* w = weights + t * top_k;
    int64_t* id = ids + t * top_k;
    // Insertion into the k best so far: a later expert passes only a strictly larger one.
    int64_t n = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (n == top_k && !(probs[e] > w[n - 1])) continue;
      int64_t j = n < top_k ? n++ : n - 1;
      for (; j > 0 && probs[e] > w[j - 1]; --j) {
        w[j] = w[j - 1];
        id[j] = id[j - 1];
      }
      w[j] = probs[e];
      id[j] = e;
    }
    if (normalize) {
      float total = 0.f;
      for (int64_t j = 0; j < top_k; ++j) total += w[j];
      for (int64_t j = 0; j < top_k; ++j) w[j] /= total;
    }
  }
}

// out[token[i]] += rows[i] for i in order: index_add_'s sum, its order. Apart from
// the products that made ``rows`` (never inlined beside them: -ffast-math would fuse
// a product and this sum into one rounding, where the per-expert loop rounds twice).
__attribute__((noinline)) void add_rows(float* out, const float* rows, const int64_t* token,
                                        int64_t n, int64_t H) {
  for (int64_t i = 0; i < n; ++i) {
    float* dst = out + token[i] * H;
    const float* src = rows + i * H;
    for (int64_t h = 0; h < H; ++h) dst[h] += src[h];
  }
}

// The router's logits as route takes them (float32, contiguous), top_k checked.
torch::Tensor routable(const torch::Tensor& logits, int64_t top_k) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_floating_point(), "logits: [T, experts], float");
  TORCH_CHECK(top_k >= 1 && top_k <= logits.size(1), "top_k: 1 .. experts");
  return logits.to(torch::kFloat).contiguous();
}

}  // namespace moe

// moe::route for Python (models/moe.py's SparseMoE.route): logits [T, experts], any
// float dtype (taken as float32) -> (weights float32 [T, top_k], ids int64 [T, top_k]).
std::vector<torch::Tensor> moe_route(torch::Tensor logits, int64_t top_k, bool normalize) {
  const torch::Tensor x = moe::routable(logits, top_k);
  const int64_t T = x.size(0), E = x.size(1);
  torch::Tensor weights = torch::empty({T, top_k}, torch::kFloat);
  torch::Tensor ids = torch::empty({T, top_k}, torch::kLong);
  moe::route(x.data_ptr<float>(), T, E, top_k, normalize, weights.data_ptr<float>(),
             ids.data_ptr<int64_t>());
  return {weights, ids};
}

// out [T, hidden] and the tokens each expert took [experts] (int64). gu_bias / dn_bias:
// each held expert's float32 bias of its gate/up and down by address (int64 [held]), or
// empty; swiglu_limit > 0: gpt-oss's clamped SwiGLU (cpu_ops.cpp) with swiglu_alpha,
// not silu or GELU. expert_scale: float32 [experts], each pick's weight times its
// expert's (Gemma 4's learned output scales), or empty.
std::vector<torch::Tensor> moe_experts(
    torch::Tensor x, torch::Tensor logits, int64_t top_k, bool normalize,
    torch::Tensor gu_where, torch::Tensor gu_values, torch::Tensor gu_scales, torch::Tensor gu_corr,
    int64_t gu_rows, int64_t gu_group, double gu_offset, double gu_factor,
    int64_t gu_table,
    torch::Tensor dn_where, torch::Tensor dn_values, torch::Tensor dn_scales, torch::Tensor dn_corr,
    int64_t dn_rows, int64_t dn_group, double dn_offset, double dn_factor,
    int64_t dn_table, bool gelu, int64_t round_rows,
    int64_t first_expert, torch::Tensor gu_bias, torch::Tensor dn_bias, double swiglu_alpha,
    double swiglu_limit, torch::Tensor expert_scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat,
              "x: float32 [T, hidden], contiguous");
  const int64_t T = x.size(0), H = x.size(1), E = logits.size(1);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == T, "logits: [T, experts]");
  const int64_t held = gu_where.size(0);
  TORCH_CHECK(first_expert >= 0 && held > 0 && first_expert + held <= E, "held experts out of range");
  for (const torch::Tensor* where : {&gu_where, &dn_where})
    TORCH_CHECK(where->scalar_type() == torch::kLong && where->is_contiguous() && where->dim() == 2 &&
                where->size(0) == held && where->size(1) == 3, "where: int64 [held experts, 3]");
  TORCH_CHECK(dn_rows == H && gu_rows % 2 == 0, "down gives hidden rows; gate/up two halves");
  for (const torch::Tensor* bias : {&gu_bias, &dn_bias})
    TORCH_CHECK(bias->numel() == 0 || (bias->scalar_type() == torch::kLong && bias->is_contiguous() &&
                                       bias->numel() == held), "bias: int64 [held experts] or empty");
  const int64_t* gu_biases = gu_bias.numel() ? gu_bias.data_ptr<int64_t>() : nullptr;
  const int64_t* dn_biases = dn_bias.numel() ? dn_bias.data_ptr<int64_t>() : nullptr;
  const quant::ManyMatrices gate_up_layout =
      quant::many_matrices(gu_values, gu_scales, gu_corr, H, gu_rows, gu_group, gu_offset, gu_factor,
                           gu_table);
  const quant::ManyMatrices down_layout =
      quant::many_matrices(dn_values, dn_scales, dn_corr, gu_rows / 2, dn_rows, dn_group, dn_offset,
                           dn_factor, dn_table);
  const torch::Tensor scores = moe::routable(logits, top_k);
  std::vector<float> weights(T * top_k);
  std::vector<int64_t> chosen(T * top_k);
  moe::route(scores.data_ptr<float>(), T, E, top_k, normalize, weights.data(), chosen.data());
  if (expert_scale.numel()) {
    TORCH_CHECK(expert_scale.scalar_type() == torch::kFloat && expert_scale.is_contiguous() &&
                expert_scale.numel() == E, "expert_scale: float32 [experts] or empty");
    const float* by_expert = expert_scale.data_ptr<float>();
    for (int64_t s = 0; s < T * top_k; ++s) weights[s] *= by_expert[chosen[s]];
  }
  // The (token, pick) slots sorted by expert, a stable order: a token's picks in turn.
  const int64_t* ids = chosen.data();
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
  // The slots go through the experts in rounds of at most ``round_rows``, so that a
  // long prompt chunk's temporaries stay bounded (2,048 tokens of 30B-A3B: 419 MB at
  // once, 13 MB a round of 512). An expert's rows are cut only every round_rows from
  // its first (a multiple of the kernel's token chunk), so each row meets the same
  // rows in the kernel's groups as uncut, as models/moe.py's loop feeds them (in
  // slices of MLP_ROWS): the K formats' last bits depend on that grouping.
  TORCH_CHECK(round_rows > 0 && round_rows % quant::kTokenChunk == 0,
              "round_rows: a positive multiple of ", quant::kTokenChunk);
  struct Piece { int64_t expert, first, count; };
  std::vector<Piece> pieces;  // in slot order, each slot in one
  for (int64_t e = first_expert; e < first_expert + held; ++e)
    for (int64_t off = 0; off < count[e]; off += round_rows)
      pieces.push_back({e - first_expert, start[e] + off, std::min(round_rows, count[e] - off)});
  const int64_t R = std::min(S, round_rows), I = gu_rows / 2;
  torch::Tensor rows = torch::empty({R, H}, x.options()), gate_up = torch::empty({R, gu_rows}, x.options());
  torch::Tensor acted = torch::empty({R, I}, x.options()), down = torch::empty({R, H}, x.options());
  torch::Tensor out = torch::zeros({T, H}, x.options());
  std::vector<int64_t> token(S);  // each slot's token
  for (int64_t i = 0; i < S; ++i) token[i] = order[i] / top_k;
  const float* src = x.data_ptr<float>();
  const float* w = weights.data();
  for (size_t p0 = 0; p0 < pieces.size();) {
    // A round: whole pieces, contiguous slots s0 .. s0 + n (the held experts' slots
    // are contiguous: sorted by expert).
    const int64_t s0 = pieces[p0].first;
    int64_t n = 0;
    std::vector<int64_t> experts, first, rows_of;
    for (; p0 < pieces.size() && n + pieces[p0].count <= R; ++p0) {
      experts.push_back(pieces[p0].expert);
      first.push_back(pieces[p0].first - s0);
      rows_of.push_back(pieces[p0].count);
      n += pieces[p0].count;
    }
    float* gathered = rows.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) std::memcpy(gathered + i * H, src + token[s0 + i] * H, H * sizeof(float));
    quant::run_many(gate_up_layout, gu_where.data_ptr<int64_t>(), experts, first, rows_of,
                    gathered, H, gate_up.data_ptr<float>(), gu_rows, gu_biases);
    torch::Tensor acted_n = acted.narrow(0, 0, n), gate_up_n = gate_up.narrow(0, 0, n);
    if (swiglu_limit > 0) clamped_swiglu_and_mul(acted_n, gate_up_n, swiglu_alpha, swiglu_limit);
    else if (gelu) gelu_tanh_and_mul(acted_n, gate_up_n);
    else silu_and_mul(acted_n, gate_up_n);
    quant::run_many(down_layout, dn_where.data_ptr<int64_t>(), experts, first, rows_of,
                    acted.data_ptr<float>(), I, down.data_ptr<float>(), H, dn_biases);
    // Each row times its routing weight, then added into its token's row in slot
    // order (two passes, as the Python path's product and index_add_).
    float* d = down.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      const float scale = w[order[s0 + i]];
      for (int64_t h = 0; h < H; ++h) d[i * H + h] *= scale;
    }
    moe::add_rows(out.data_ptr<float>(), d, token.data() + s0, n, H);
  }
  return {out, counts};
}

// A mixture's MLP half for decode tokens, from the router on: its arguments (those of
// llama_decode_moe_layer after the attention's), converted once a step by
// decode_stack.cpp.
struct MixtureArgs {
  torch::Tensor router, gu_where, gu_values, gu_scales, gu_corr, dn_where, dn_values,
      dn_scales, dn_corr, load;
  int64_t router_max_rows, top_k, gu_rows, gu_group, gu_table, dn_rows, dn_group, dn_table, round_rows,
      first_expert;
  bool normalize, gelu;
  double gu_offset, gu_factor, dn_offset, dn_factor;
};

// add + RMSNorm of the attention's output into the stream, the router's logits
// (small_linear's up to router_max_rows tokens, torch's linear above, as
// runner/linear/cpu_small_batch.py chooses), then moe_experts; the tokens each expert
// took go into ``load`` (int64 [experts], the layer's table: no tensor for Python to
// convert a layer). Returns (the experts' sum, the stream): a tensor-parallel rank's
// sum is of the experts it holds, all-reduced by the caller.
std::vector<torch::Tensor> mixture_mlp(const torch::Tensor& o, const torch::Tensor& stream,
                                       const torch::Tensor& post_norm, double eps,
                                       const MixtureArgs& m) {
  TORCH_CHECK(m.router.scalar_type() == torch::kFloat && m.router.dim() == 2 && m.router.is_contiguous(),
              "router: float32 [experts, hidden], contiguous");
  TORCH_CHECK(m.load.scalar_type() == torch::kLong && m.load.dim() == 1 && m.load.size(0) == m.router.size(0),
              "load: int64 [experts]");
  torch::Tensor x = torch::empty_like(o);
  rms_norm(x, o, stream, post_norm, eps);
  torch::Tensor logits;
  if (x.size(0) <= m.router_max_rows) {
    logits = torch::empty({x.size(0), m.router.size(0)}, x.options());
    small_linear(logits, x, m.router, c10::nullopt);
  } else {
    logits = torch::linear(x, m.router);
  }
  auto experts = moe_experts(x, logits, m.top_k, m.normalize, m.gu_where, m.gu_values, m.gu_scales,
                             m.gu_corr, m.gu_rows, m.gu_group, m.gu_offset, m.gu_factor, m.gu_table,
                             m.dn_where, m.dn_values, m.dn_scales, m.dn_corr, m.dn_rows, m.dn_group,
                             m.dn_offset, m.dn_factor, m.dn_table, m.gelu,
                             m.round_rows, m.first_expert, torch::empty({0}, torch::kLong),
                             torch::empty({0}, torch::kLong), 0.0, 0.0,
                             torch::empty({0}, torch::kFloat));
  m.load.copy_(experts[1]);
  return {experts[0], stream};
}

// A mixture's whole decoder layer for decode tokens, in one call: the attention half
// (decode_layer.cpp's llama_decode_attention), then mixture_mlp; the calls
// runner/fused_decode.py makes one by one for such a layer, in the same order on the
// same kernels, so the result is theirs bit for bit. What it saves is the Python
// between them (module calls, the router's linear method, the experts' wrapper: about
// 0.1 ms a layer, 3-5 ms of a 30B-A3B decode step of about 110 on 2 cores:
// docs/BENCHMARKS.md). The router is float32 [experts, hidden] without a bias. One
// process, no shared expert (the caller's checks). Returns (the experts' sum, the
// stream).
std::vector<torch::Tensor> llama_decode_moe_layer(
    torch::Tensor h, torch::Tensor residual, torch::Tensor input_norm, torch::Tensor post_norm,
    double eps, PackedArgs qkv, PackedArgs o_proj, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, torch::Tensor positions, torch::Tensor cos_sin, torch::Tensor kv_cache,
    int64_t layer, torch::Tensor slots, torch::Tensor block_tables,
    torch::Tensor context_lens, torch::Tensor row_starts, double scale, int64_t window,
    torch::Tensor q_norm, torch::Tensor k_norm, torch::Tensor qkv_bias, torch::Tensor router,
    int64_t router_max_rows, int64_t top_k, bool normalize,
    torch::Tensor gu_where, torch::Tensor gu_values, torch::Tensor gu_scales, torch::Tensor gu_corr,
    int64_t gu_rows, int64_t gu_group, double gu_offset, double gu_factor,
    int64_t gu_table,
    torch::Tensor dn_where, torch::Tensor dn_values, torch::Tensor dn_scales, torch::Tensor dn_corr,
    int64_t dn_rows, int64_t dn_group, double dn_offset, double dn_factor,
    int64_t dn_table, bool gelu, int64_t round_rows,
    int64_t first_expert, torch::Tensor load) {
  const MixtureArgs m{router, gu_where, gu_values, gu_scales, gu_corr, dn_where, dn_values,
                      dn_scales, dn_corr, load, router_max_rows, top_k, gu_rows, gu_group,
                      gu_table, dn_rows, dn_group, dn_table, round_rows, first_expert, normalize,
                      gelu, gu_offset, gu_factor, dn_offset, dn_factor};
  auto attention = llama_decode_attention(
      h, residual, input_norm, eps, qkv, o_proj, num_heads, num_kv_heads, head_dim, positions,
      cos_sin, kv_cache, layer, slots, block_tables, context_lens, row_starts, scale, window,
      q_norm, k_norm, qkv_bias);
  return mixture_mlp(attention[0], attention[1], post_norm, eps, m);
}
