// LFM2's gated short convolution for decode tokens (models/lfm2.py has the definition),
// and its whole convolution layer in one call.
//
// A token's in_proj output is [B | C | x] (C channels each); its window in the state
// cache holds the last width - 1 values of B * x per channel, oldest first:
//   y[c] = C[c] * (sum_j taps[c, j] * [window, B * x][c, j] (+ bias[c]))
// and the window shifts in place to end at this token's B * x.
//
// After decode_layer.cpp (normed_input, packed_linear, llama_decode_mlp) and delta_rule_ops.cpp
// (checked_slots) in the one translation unit (kernels/cpu.py).

#include <torch/python.h>

#include <ATen/Parallel.h>
#include <vector>

// bcx [T, 3C] (one token per sequence), taps [C, W], bias [C] or empty, windows
// [slots, C, W - 1] (sequence t's at slots[t]), y [T, C]: all float32, contiguous.
void short_conv_step(torch::Tensor y, torch::Tensor bcx, torch::Tensor taps,
                     torch::Tensor bias, torch::Tensor windows, torch::Tensor slots) {
  for (auto* t : {&y, &bcx, &taps, &windows}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "short_conv_step takes contiguous float32 tensors");
  }
  const int64_t tokens = bcx.size(0), channels = taps.size(0), width = taps.size(1);
  const int64_t kept = width - 1;
  TORCH_CHECK(bcx.size(1) == 3 * channels && y.size(0) == tokens && y.size(1) == channels);
  TORCH_CHECK(windows.size(1) == channels && windows.size(2) == kept && kept >= 1);
  const bool biased = bias.numel() > 0;
  TORCH_CHECK(!biased || (bias.numel() == channels && bias.scalar_type() == torch::kFloat32 &&
                          bias.is_contiguous()));
  const int64_t* slot = checked_slots(slots, tokens, windows.size(0));
  const float *in = bcx.data_ptr<float>(), *w = taps.data_ptr<float>();
  const float* bp = biased ? bias.data_ptr<float>() : nullptr;
  float *out = y.data_ptr<float>(), *ws = windows.data_ptr<float>();
  at::parallel_for(0, tokens * channels, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / channels, c = item % channels;
      const float* row = in + t * 3 * channels;
      const float now = row[c] * row[2 * channels + c];  // B * x
      float* window = ws + (slot[t] * channels + c) * kept;
      const float* tap = w + c * width;
      float sum = tap[kept] * now;
      for (int64_t j = 0; j < kept; ++j) sum += tap[j] * window[j];
      for (int64_t j = 0; j + 1 < kept; ++j) window[j] = window[j + 1];
      window[kept - 1] = now;
      if (biased) sum += bp[c];
      out[item] = row[channels + c] * sum;  // C * conv
    }
  });
}

// One LFM2 convolution layer for a batch of decode tokens (one per sequence): (add +)
// RMSNorm, in_proj, the gated convolution in the slots, out_proj, then the MLP half
// (llama_decode_mlp: add + RMSNorm, gate/up, silu * up, down). The layer-by-layer path's
// calls in its order, so the result is the same bit for bit. in_proj and out_proj
// unbiased (runner/fused_decode.py checks). Returns (this layer's output, the stream).
std::vector<torch::Tensor> short_conv_decode_layer(
    torch::Tensor h, torch::Tensor residual, torch::Tensor input_norm, torch::Tensor post_norm,
    double eps, PackedArgs in_proj, torch::Tensor taps, torch::Tensor bias,
    torch::Tensor windows, torch::Tensor slots, PackedArgs out_proj, PackedArgs gate_up,
    PackedArgs down) {
  torch::Tensor x;
  std::tie(x, residual) = normed_input(h, residual, input_norm, eps);
  torch::Tensor bcx = packed_linear(x, in_proj);
  torch::Tensor y = torch::empty({h.size(0), taps.size(0)}, h.options());
  short_conv_step(y, bcx, taps, bias, windows, slots);
  torch::Tensor o = packed_linear(y, out_proj);
  auto mlp = llama_decode_mlp(o, residual, torch::empty({0}, h.options()), post_norm, eps,
                              gate_up, down, false);
  return {mlp[0], mlp[1]};
}
