// Every decoder layer of a decode-only step in one call: decode_layer.cpp's
// llama_decode_layer for a dense layer, moe_ops.cpp's llama_decode_moe_layer for a
// mixture's, one after the other from C++ with the stream passed along, the calls
// runner/fused_decode.py otherwise makes layer by layer, in the same order on the same
// kernels: the result is theirs bit for bit. What it saves is the Python between
// layers (the module call, the fused path's checks and arguments), at the price of
// converting each layer's fixed arguments here: batch-1 decode steps 1.02-1.04x on a
// 2-core VM (the 1B, 8B and 30B-A3B files; docs/BENCHMARKS.md).
//
// ``layers``: one tuple a layer, as runner/fused_decode.py's stack_arguments builds it
// once per model:
//   0 mixture (bool)   1 input norm   2 post-attention norm   3 eps   4 qkv parts
//   5 o parts   6 gate/up parts   7 down parts (both empty for a mixture)   8 heads
//   9 KV heads   10 head size   11 the layer's index in the KV cache   12 scale
//   13 q norm   14 k norm   15 qkv bias   16 post-attention-output norm
//   17 post-MLP norm   18 GeGLU (bool)   19 which rotary table (index into the lists)
//   20 a mixture's llama_decode_moe_layer arguments from the router on (a tuple)
// Optional tensors are empty where a layer has none, as the per-layer calls take them.
// ``windows``: each layer's sliding window this step (0: none).

#include <functional>

namespace {

PackedArgs packed_args(const pybind11::handle& parts) { return parts.cast<PackedArgs>(); }

}  // namespace

// Returns (the last layer's output, the stream): the final norm is the caller's. The
// arguments are converted first, with the GIL; the layers then run without it, so that
// the engine core's other threads (its sockets: server/core_process.py) are not held
// off for a whole forward (one call a layer let them in between layers).
std::vector<torch::Tensor> llama_decode_stack(
    torch::Tensor h, pybind11::list layers, std::vector<int64_t> windows,
    std::vector<torch::Tensor> positions, std::vector<torch::Tensor> cos_sin,
    torch::Tensor kv_cache, torch::Tensor slots, torch::Tensor block_tables,
    torch::Tensor context_lens, torch::Tensor row_starts) {
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == static_cast<int64_t>(layers.size()),
              "windows: one a layer");
  TORCH_CHECK(positions.size() == cos_sin.size() && !positions.empty(),
              "positions and cos_sin: one pair a rotary table");
  using Layer = std::function<std::vector<torch::Tensor>(const torch::Tensor&, const torch::Tensor&)>;
  std::vector<Layer> calls;
  calls.reserve(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const pybind11::tuple a = layers[i].cast<pybind11::tuple>();
    TORCH_CHECK(a.size() == 21, "a layer's arguments: 21 entries");
    auto tensor = [&](int j) { return a[j].cast<torch::Tensor>(); };
    auto integer = [&](int j) { return a[j].cast<int64_t>(); };
    const int64_t rope = integer(19);
    TORCH_CHECK(rope >= 0 && rope < static_cast<int64_t>(cos_sin.size()), "rotary table index");
    const torch::Tensor in_norm = tensor(1), post_norm = tensor(2), q_norm = tensor(13),
                        k_norm = tensor(14), qkv_bias = tensor(15), pos = positions[rope],
                        table = cos_sin[rope];
    const double eps = a[3].cast<double>(), scale = a[12].cast<double>();
    const PackedArgs qkv = packed_args(a[4]), o_proj = packed_args(a[5]);
    const int64_t heads = integer(8), kv_heads = integer(9), head_dim = integer(10),
                  layer = integer(11), window = windows[i];
    if (!a[0].cast<bool>()) {
      calls.push_back([=, gate_up = packed_args(a[6]), down = packed_args(a[7]),
                       post_attn_norm = tensor(16), post_mlp_norm = tensor(17),
                       gelu = a[18].cast<bool>()](const torch::Tensor& x, const torch::Tensor& r) {
        return llama_decode_layer(x, r, in_norm, post_norm, eps, qkv, o_proj, gate_up, down,
                                  heads, kv_heads, head_dim, pos, table, kv_cache, layer, slots,
                                  block_tables, context_lens, row_starts, scale, window, q_norm,
                                  k_norm, qkv_bias, post_attn_norm, post_mlp_norm, gelu);
      });
    } else {
      const pybind11::tuple m = a[20].cast<pybind11::tuple>();
      TORCH_CHECK(m.size() == 22, "a mixture's arguments: 22 entries");
      auto mt = [&](int j) { return m[j].cast<torch::Tensor>(); };
      auto mi = [&](int j) { return m[j].cast<int64_t>(); };
      calls.push_back([=, router = mt(0), router_rows = mi(1), top_k = mi(2),
                       normalize = m[3].cast<bool>(), gu_where = mt(4), gu_values = mt(5),
                       gu_scales = mt(6), gu_corr = mt(7), gu_rows = mi(8), gu_group = mi(9),
                       gu_offset = m[10].cast<double>(), dn_where = mt(11), dn_values = mt(12),
                       dn_scales = mt(13), dn_corr = mt(14), dn_rows = mi(15), dn_group = mi(16),
                       dn_offset = m[17].cast<double>(), gelu = m[18].cast<bool>(),
                       round_rows = mi(19), first_expert = mi(20),
                       load = mt(21)](const torch::Tensor& x, const torch::Tensor& r) {
        return llama_decode_moe_layer(
            x, r, in_norm, post_norm, eps, qkv, o_proj, heads, kv_heads, head_dim, pos, table,
            kv_cache, layer, slots, block_tables, context_lens, row_starts, scale, window,
            q_norm, k_norm, qkv_bias, router, router_rows, top_k, normalize, gu_where,
            gu_values, gu_scales, gu_corr, gu_rows, gu_group, gu_offset, dn_where, dn_values,
            dn_scales, dn_corr, dn_rows, dn_group, dn_offset, gelu, round_rows, first_expert,
            load);
      });
    }
  }
  torch::Tensor residual = h.new_empty({0});
  {
    pybind11::gil_scoped_release released;
    for (const Layer& call : calls) {
      std::vector<torch::Tensor> out = call(h, residual);
      h = out[0];
      residual = out[1];
    }
  }
  return {h, residual};
}
