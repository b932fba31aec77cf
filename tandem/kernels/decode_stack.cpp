// Every decoder layer of a decode-only step in one call: decode_layer.cpp's
// llama_decode_layer for a dense layer, moe_ops.cpp's llama_decode_moe_layer for a
// mixture's, one after the other from C++ with the stream passed along, the calls
// runner/fused_decode.py otherwise makes layer by layer, in the same order on the same
// kernels: the result is theirs bit for bit. What it saves is the Python between
// layers (the module call, the fused path's checks and arguments), at the price of
// converting each layer's fixed arguments here: batch-1 decode steps 1.015-1.02x on a
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

namespace {

PackedArgs packed_args(const pybind11::handle& parts) { return parts.cast<PackedArgs>(); }

}  // namespace

// Returns (the last layer's output, the stream): the final norm is the caller's.
std::vector<torch::Tensor> llama_decode_stack(
    torch::Tensor h, pybind11::list layers, std::vector<int64_t> windows,
    std::vector<torch::Tensor> positions, std::vector<torch::Tensor> cos_sin,
    torch::Tensor kv_cache, torch::Tensor slots, torch::Tensor block_tables,
    torch::Tensor context_lens, torch::Tensor row_starts) {
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == static_cast<int64_t>(layers.size()),
              "windows: one a layer");
  TORCH_CHECK(positions.size() == cos_sin.size() && !positions.empty(),
              "positions and cos_sin: one pair a rotary table");
  torch::Tensor residual = h.new_empty({0});
  for (size_t i = 0; i < layers.size(); ++i) {
    const pybind11::tuple a = layers[i].cast<pybind11::tuple>();
    TORCH_CHECK(a.size() == 21, "a layer's arguments: 21 entries");
    auto tensor = [&](int j) { return a[j].cast<torch::Tensor>(); };
    auto integer = [&](int j) { return a[j].cast<int64_t>(); };
    const int64_t rope = integer(19);
    TORCH_CHECK(rope >= 0 && rope < static_cast<int64_t>(cos_sin.size()), "rotary table index");
    std::vector<torch::Tensor> out;
    if (!a[0].cast<bool>()) {
      out = llama_decode_layer(
          h, residual, tensor(1), tensor(2), a[3].cast<double>(), packed_args(a[4]),
          packed_args(a[5]), packed_args(a[6]), packed_args(a[7]), integer(8), integer(9),
          integer(10), positions[rope], cos_sin[rope], kv_cache, integer(11), slots,
          block_tables, context_lens, row_starts, a[12].cast<double>(), windows[i],
          tensor(13), tensor(14), tensor(15), tensor(16), tensor(17), a[18].cast<bool>());
    } else {
      const pybind11::tuple m = a[20].cast<pybind11::tuple>();
      TORCH_CHECK(m.size() == 22, "a mixture's arguments: 22 entries");
      auto mt = [&](int j) { return m[j].cast<torch::Tensor>(); };
      auto mi = [&](int j) { return m[j].cast<int64_t>(); };
      out = llama_decode_moe_layer(
          h, residual, tensor(1), tensor(2), a[3].cast<double>(), packed_args(a[4]),
          packed_args(a[5]), integer(8), integer(9), integer(10), positions[rope],
          cos_sin[rope], kv_cache, integer(11), slots, block_tables, context_lens,
          row_starts, a[12].cast<double>(), windows[i], tensor(13), tensor(14), tensor(15),
          mt(0), mi(1), mi(2), m[3].cast<bool>(),
          mt(4), mt(5), mt(6), mt(7), mi(8), mi(9), m[10].cast<double>(),
          mt(11), mt(12), mt(13), mt(14), mi(15), mi(16), m[17].cast<double>(),
          m[18].cast<bool>(), mi(19), mi(20), mt(21));
    }
    h = out[0];
    residual = out[1];
  }
  return {h, residual};
}
