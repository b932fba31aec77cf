// One Llama-family decoder layer for a batch of decode tokens, in a single call.
//
// It is the Python layer's sequence of compiled calls (cpu_ops.cpp, quant_ops.cpp),
// made from C++: add + RMSNorm, the fused qkv projection, rotary in place, the K/V
// write, paged decode attention, the output projection, add + RMSNorm, gate/up,
// silu * up, down. Same kernels, same order, same buffers' shapes: the result equals
// the layer-by-layer path bit for bit. What it saves is the Python between them
// (module calls, views, dispatch: ~100 us a layer on a 2-core CPU), which at batch 1
// on a small model costs as much as the matmuls (docs/BENCHMARKS.md).
//
// A linear layer is a tuple (values, scales, corr or empty, rows, group, offset) as
// tandem/quant/packed.py lays it out; no biases (runner/fused_decode.py checks).

using PackedArgs = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, double>;

namespace {

torch::Tensor packed_linear(const torch::Tensor& x, const PackedArgs& w) {
  const auto& [values, scales, corr, rows, group, offset] = w;
  torch::Tensor out = torch::empty({x.size(0), rows}, x.options());
  quant_linear(out, x, values, scales,
               corr.numel() > 0 ? c10::optional<torch::Tensor>(corr) : c10::nullopt, c10::nullopt,
               rows, group, offset);
  return out;
}

}  // namespace

// h [T, hidden] (the previous layer's output), residual [T, hidden] (the stream, updated
// in place; empty for the first layer). Returns (this layer's output, the stream).
std::vector<torch::Tensor> llama_decode_layer(
    torch::Tensor h, torch::Tensor residual, torch::Tensor input_norm,
    torch::Tensor post_norm, double eps, PackedArgs qkv, PackedArgs o_proj,
    PackedArgs gate_up, PackedArgs down, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, torch::Tensor positions, torch::Tensor cos_sin, torch::Tensor k_cache,
    torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_tables,
    torch::Tensor context_lens, double scale, int64_t window) {
  const int64_t T = h.size(0);
  torch::Tensor x = torch::empty_like(h);
  if (residual.numel() == 0) {
    residual = h;
    rms_norm(x, h, c10::nullopt, input_norm, eps);
  } else {
    rms_norm(x, h, residual, input_norm, eps);
  }
  torch::Tensor qkv_out = packed_linear(x, qkv);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::Tensor q = qkv_out.narrow(1, 0, q_size).view({T, num_heads, head_dim});
  torch::Tensor k = qkv_out.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
  torch::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
  rotary(q, k, positions, cos_sin);
  write_kv(k, v, k_cache, v_cache, slots);
  torch::Tensor attn = torch::empty({T, num_heads, head_dim}, h.options());
  decode_attention(attn, q, k_cache, v_cache, block_tables, context_lens, scale, window);
  torch::Tensor o = packed_linear(attn.view({T, q_size}), o_proj);
  torch::Tensor x2 = torch::empty_like(h);
  rms_norm(x2, o, residual, post_norm, eps);
  torch::Tensor gu = packed_linear(x2, gate_up);
  torch::Tensor act = torch::empty({T, gu.size(1) / 2}, h.options());
  silu_and_mul(act, gu);
  return {packed_linear(act, down), residual};
}
