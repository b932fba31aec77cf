// One Llama-family (or Gemma 3) decoder layer for a batch of decode tokens, in a single call
// (or a few tokens per sequence: speculative verification; row_starts as
// paged_attention_rows takes it, empty for one token each).
//
// It is the Python layer's sequence of compiled calls (cpu_ops.cpp, quant_ops.cpp),
// made from C++: add + RMSNorm, the fused qkv projection, (q/k norms,) rotary in place,
// the K/V write, paged decode attention, the output projection, (norm,) add + RMSNorm,
// gate/up, silu or GELU-tanh * up, down(, norm). Same kernels, same order, same buffers' shapes: the result equals
// the layer-by-layer path bit for bit. What it saves is the Python between them
// (module calls, views, dispatch: ~100 us a layer on a 2-core CPU), which at batch 1
// on a small model costs as much as the matmuls (docs/BENCHMARKS.md).
//
// A linear layer is a list of parts (first output column, values, scales, corr or
// empty, rows, group, offset, factor, table), each laid out as tandem/quant/packed.py lays it out (a
// fused projection's parts may have different formats, as in GGUF files that quantize
// v more finely than q and k). Only the qkv projection may have a bias (Qwen2's):
// float32 [its columns], each part given its slice, as runner/linear/quantized.py
// does; empty for none (runner/fused_decode.py checks the rest have none).

#include <tuple>

using PackedPart = std::tuple<int64_t, torch::Tensor, torch::Tensor, torch::Tensor, int64_t,
                              int64_t, double, double, int64_t>;
using PackedArgs = std::vector<PackedPart>;

namespace {

torch::Tensor packed_linear(const torch::Tensor& x, const PackedArgs& parts,
                            const torch::Tensor& bias = torch::Tensor()) {
  int64_t columns = 0;
  for (const auto& part : parts) columns = std::max(columns, std::get<0>(part) + std::get<4>(part));
  const bool biased = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!biased || bias.numel() == columns, "bias: one value a column");
  torch::Tensor out = torch::empty({x.size(0), columns}, x.options());
  for (const auto& [start, values, scales, corr, rows, group, offset, factor, table] : parts) {
    torch::Tensor slice = parts.size() == 1 ? out : out.narrow(1, start, rows);
    quant_linear(slice, x, values, scales,
                 corr.numel() > 0 ? c10::optional<torch::Tensor>(corr) : c10::nullopt,
                 biased ? c10::optional<torch::Tensor>(bias.narrow(0, start, rows)) : c10::nullopt,
                 rows, group, offset, factor, table);
  }
  return out;
}

// Layer ``layer``'s key and value blocks of the paged cache [layers, 2, blocks, ...]
// (runner/kv_cache.py): views, as the Python path's ``kv_cache[layer]`` unpacks them.
// Taken here rather than in Python, where the unpacking cost 25 us a layer on a 2-core
// VM right after a layer's kernels (its few microseconds alone).
std::pair<torch::Tensor, torch::Tensor> layer_blocks(const torch::Tensor& kv_cache, int64_t layer) {
  TORCH_CHECK(kv_cache.dim() >= 3 && kv_cache.size(1) == 2 && layer >= 0 && layer < kv_cache.size(0),
              "kv_cache: [layers, 2, blocks, ...], layer in range");
  torch::Tensor blocks = kv_cache.select(0, layer);
  return {blocks.select(0, 0), blocks.select(0, 1)};
}

// A layer's input: h [T, hidden] (the previous layer's output) added into the stream
// ``residual`` in place and RMS-normed; the first layer has no stream yet (residual
// empty): h is the stream. Returns (the normed input, the stream).
std::pair<torch::Tensor, torch::Tensor> normed_input(const torch::Tensor& h, torch::Tensor residual,
                                                     const torch::Tensor& norm, double eps) {
  torch::Tensor x = torch::empty_like(h);
  if (residual.numel() == 0) {
    rms_norm(x, h, c10::nullopt, norm, eps);
    return {x, h};
  }
  rms_norm(x, h, residual, norm, eps);
  return {x, residual};
}

}  // namespace

// The attention half: (add +) RMSNorm, the fused qkv projection, (q/k norms,) rotary,
// the K/V write, paged attention, the output projection. h [T, hidden] (the previous
// layer's output), residual [T, hidden] (the stream, updated in place; empty for the
// first layer). Returns (the output projection's result, the stream): a
// tensor-parallel rank's o is its partial sum, all-reduced before the MLP half.
std::vector<torch::Tensor> llama_decode_attention(
    torch::Tensor h, torch::Tensor residual, torch::Tensor input_norm, double eps,
    PackedArgs qkv, PackedArgs o_proj, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, torch::Tensor positions, torch::Tensor cos_sin, torch::Tensor kv_cache,
    int64_t layer, torch::Tensor slots, torch::Tensor block_tables,
    torch::Tensor context_lens, torch::Tensor row_starts, double scale, int64_t window,
    torch::Tensor q_norm, torch::Tensor k_norm, torch::Tensor qkv_bias) {
  const int64_t T = h.size(0);
  torch::Tensor x;
  std::tie(x, residual) = normed_input(h, residual, input_norm, eps);
  torch::Tensor qkv_out = packed_linear(x, qkv, qkv_bias);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  torch::Tensor q = qkv_out.narrow(1, 0, q_size).view({T, num_heads, head_dim});
  torch::Tensor k = qkv_out.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
  torch::Tensor v = qkv_out.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
  if (q_norm.numel() > 0) {  // out of place, as the layer-by-layer path
    torch::Tensor qn = torch::empty({T, num_heads, head_dim}, h.options());
    torch::Tensor kn = torch::empty({T, num_kv_heads, head_dim}, h.options());
    rms_norm_heads(qn, q, q_norm, eps);
    rms_norm_heads(kn, k, k_norm, eps);
    q = qn;
    k = kn;
  }
  rotary(q, k, positions, cos_sin);
  const auto [k_cache, v_cache] = layer_blocks(kv_cache, layer);
  write_kv(k, v, k_cache, v_cache, slots);
  torch::Tensor attn = torch::empty({T, num_heads, head_dim}, h.options());
  paged_attention_rows(attn, q, k_cache, v_cache, block_tables, context_lens, row_starts,
                       scale, window, torch::empty({0}, h.options().dtype(torch::kFloat)));
  return {packed_linear(attn.view({T, q_size}), o_proj), residual};
}

// The MLP half: (RMSNorm of the attention's output: Gemma 3,) add + RMSNorm, gate/up,
// silu or GELU-tanh (``gelu``: GeGLU) * up, down. Returns (down's result, the stream):
// a tensor-parallel rank's is its partial sum.
std::vector<torch::Tensor> llama_decode_mlp(
    torch::Tensor o, torch::Tensor residual, torch::Tensor post_attn_norm,
    torch::Tensor post_norm, double eps, PackedArgs gate_up, PackedArgs down, bool gelu) {
  const int64_t T = o.size(0);
  if (post_attn_norm.numel() > 0) {
    torch::Tensor normed = torch::empty_like(o);
    rms_norm(normed, o, c10::nullopt, post_attn_norm, eps);
    o = normed;
  }
  torch::Tensor x2 = torch::empty_like(o);
  rms_norm(x2, o, residual, post_norm, eps);
  torch::Tensor gu = packed_linear(x2, gate_up);
  torch::Tensor act = torch::empty({T, gu.size(1) / 2}, o.options());
  if (gelu) {
    gelu_tanh_and_mul(act, gu);
  } else {
    silu_and_mul(act, gu);
  }
  return {packed_linear(act, down), residual};
}

// The MLP's output as it joins the stream: RMSNorm'd where the layer has a norm after
// its MLP (Gemma 3; on a tensor-parallel rank, after the all-reduce), else as it is.
torch::Tensor after_mlp(const torch::Tensor& out, const torch::Tensor& post_mlp_norm, double eps) {
  if (post_mlp_norm.numel() == 0) return out;
  torch::Tensor normed = torch::empty_like(out);
  rms_norm(normed, out, c10::nullopt, post_mlp_norm, eps);
  return normed;
}

// The whole layer: both halves, then (Gemma 3) the RMSNorm of the MLP's output before
// it joins the stream. Optional parts are empty tensors where the layer has none:
// q_norm / k_norm (per head, before rotary: Qwen3, Gemma 3), qkv_bias (Qwen2),
// post_attn_norm / post_mlp_norm. Returns (this layer's output, the stream).
std::vector<torch::Tensor> llama_decode_layer(
    torch::Tensor h, torch::Tensor residual, torch::Tensor input_norm,
    torch::Tensor post_norm, double eps, PackedArgs qkv, PackedArgs o_proj,
    PackedArgs gate_up, PackedArgs down, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, torch::Tensor positions, torch::Tensor cos_sin, torch::Tensor kv_cache,
    int64_t layer, torch::Tensor slots, torch::Tensor block_tables,
    torch::Tensor context_lens, torch::Tensor row_starts, double scale, int64_t window,
    torch::Tensor q_norm, torch::Tensor k_norm, torch::Tensor qkv_bias,
    torch::Tensor post_attn_norm, torch::Tensor post_mlp_norm, bool gelu) {
  auto attention = llama_decode_attention(
      h, residual, input_norm, eps, qkv, o_proj, num_heads, num_kv_heads, head_dim,
      positions, cos_sin, kv_cache, layer, slots, block_tables, context_lens, row_starts,
      scale, window, q_norm, k_norm, qkv_bias);
  auto mlp = llama_decode_mlp(attention[0], attention[1], post_attn_norm, post_norm, eps,
                              gate_up, down, gelu);
  return {after_mlp(mlp[0], post_mlp_norm, eps), mlp[1]};
}
