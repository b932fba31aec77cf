// Every decoder layer of a decode-only step in one call: decode_layer.cpp's
// llama_decode_layer's calls for a dense layer, moe_ops.cpp's llama_decode_moe_layer's
// for a mixture's, one after the other from C++ with the stream passed along, the calls
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

#include <optional>

namespace {

PackedArgs packed_args(const pybind11::handle& parts) { return parts.cast<PackedArgs>(); }

// A dense layer's fixed arguments (entries 1-19 of its tuple above), converted once.
struct DenseLayer {
  torch::Tensor in_norm, post_norm, q_norm, k_norm, qkv_bias, post_attn_norm, post_mlp_norm,
      positions, cos_sin;
  double eps, scale;
  PackedArgs qkv, o_proj, gate_up, down;
  int64_t heads, kv_heads, head_dim, layer, window;
  bool gelu;
};

DenseLayer dense_layer(const pybind11::tuple& a, int64_t window,
                       const std::vector<torch::Tensor>& positions,
                       const std::vector<torch::Tensor>& cos_sin) {
  TORCH_CHECK(a.size() == 21, "a layer's arguments: 21 entries");
  auto tensor = [&](int j) { return a[j].cast<torch::Tensor>(); };
  auto integer = [&](int j) { return a[j].cast<int64_t>(); };
  const int64_t rope = integer(19);
  TORCH_CHECK(rope >= 0 && rope < static_cast<int64_t>(cos_sin.size()), "rotary table index");
  return {tensor(1), tensor(2), tensor(13), tensor(14), tensor(15), tensor(16), tensor(17),
          positions[rope], cos_sin[rope], a[3].cast<double>(), a[12].cast<double>(),
          packed_args(a[4]), packed_args(a[5]), packed_args(a[6]), packed_args(a[7]),
          integer(8), integer(9), integer(10), integer(11), window, a[18].cast<bool>()};
}

// A mixture's arguments from the router on (entry 20 of its tuple), converted once.
MixtureArgs mixture_args(const pybind11::tuple& a) {
  const pybind11::tuple m = a[20].cast<pybind11::tuple>();
  TORCH_CHECK(m.size() == 26, "a mixture's arguments: 26 entries");
  auto t = [&](int j) { return m[j].cast<torch::Tensor>(); };
  auto i = [&](int j) { return m[j].cast<int64_t>(); };
  auto f = [&](int j) { return m[j].cast<double>(); };
  // router, router rows, top-k, normalize, then gate/up's where, values, scales, corr,
  // rows, group, offset, factor, table (4-12), down's (13-21), GELU, round rows, first
  // expert, load
  return {t(0), t(4), t(5), t(6), t(7), t(13), t(14), t(15), t(16), t(25),
          i(1), i(2), i(8), i(9), i(12), i(17), i(18), i(21), i(23), i(24),
          m[3].cast<bool>(), m[22].cast<bool>(), f(10), f(11), f(19), f(20)};
}

// A layer of either kind, converted once: its attention and norms, and a mixture's
// arguments where it is one.
struct StackLayer {
  DenseLayer d;
  std::optional<MixtureArgs> mixture;
};

std::vector<StackLayer> stack_layers(const pybind11::list& layers, const std::vector<int64_t>& windows,
                                     const std::vector<torch::Tensor>& positions,
                                     const std::vector<torch::Tensor>& cos_sin) {
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == static_cast<int64_t>(layers.size()),
              "windows: one a layer");
  TORCH_CHECK(positions.size() == cos_sin.size() && !positions.empty(),
              "positions and cos_sin: one pair a rotary table");
  std::vector<StackLayer> out;
  out.reserve(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const pybind11::tuple a = layers[i].cast<pybind11::tuple>();
    StackLayer layer{dense_layer(a, windows[i], positions, cos_sin), std::nullopt};
    if (a[0].cast<bool>()) layer.mixture = mixture_args(a);
    out.push_back(std::move(layer));
  }
  return out;
}

// The attention half of layer d (both kinds).
std::vector<torch::Tensor> stack_attention(const DenseLayer& d, const torch::Tensor& h,
                                           const torch::Tensor& residual,
                                           const torch::Tensor& kv_cache, const torch::Tensor& slots,
                                           const torch::Tensor& block_tables,
                                           const torch::Tensor& context_lens,
                                           const torch::Tensor& row_starts) {
  return llama_decode_attention(h, residual, d.in_norm, d.eps, d.qkv, d.o_proj, d.heads,
                                d.kv_heads, d.head_dim, d.positions, d.cos_sin, kv_cache, d.layer,
                                slots, block_tables, context_lens, row_starts, d.scale, d.window,
                                d.q_norm, d.k_norm, d.qkv_bias);
}

// The MLP half of a layer (a mixture's from its router on): (its output, or a rank's
// partial sum of it, and the stream).
std::vector<torch::Tensor> stack_mlp(const StackLayer& layer, const torch::Tensor& o,
                                     const torch::Tensor& residual) {
  const DenseLayer& d = layer.d;
  if (layer.mixture) return mixture_mlp(o, residual, d.post_norm, d.eps, *layer.mixture);
  return llama_decode_mlp(o, residual, d.post_attn_norm, d.post_norm, d.eps, d.gate_up, d.down,
                          d.gelu);
}

}  // namespace

// Returns (the last layer's output, the stream): the final norm is the caller's. The
// arguments are converted first, with the GIL; the layers then run without it, so that
// the engine core's other threads (its sockets: server/core_process.py) are not held
// off for a whole forward (one call a layer let them in between layers). Each layer is
// llama_decode_layer's or llama_decode_moe_layer's calls in their order: attention,
// then the MLP half, then (Gemma 3) the norm after the MLP.
std::vector<torch::Tensor> llama_decode_stack(
    torch::Tensor h, pybind11::list layers, std::vector<int64_t> windows,
    std::vector<torch::Tensor> positions, std::vector<torch::Tensor> cos_sin,
    torch::Tensor kv_cache, torch::Tensor slots, torch::Tensor block_tables,
    torch::Tensor context_lens, torch::Tensor row_starts) {
  const std::vector<StackLayer> stack = stack_layers(layers, windows, positions, cos_sin);
  torch::Tensor residual = h.new_empty({0});
  {
    pybind11::gil_scoped_release released;
    for (const StackLayer& layer : stack) {
      auto attention = stack_attention(layer.d, h, residual, kv_cache, slots, block_tables,
                                       context_lens, row_starts);
      auto mlp = stack_mlp(layer, attention[0], attention[1]);
      h = after_mlp(mlp[0], layer.d.post_mlp_norm, layer.d.eps);
      residual = mlp[1];
    }
  }
  return {h, residual};
}

// A tensor-parallel rank's layers in one call, for ranks that meet in shared memory
// (runner/shm_group.py): each layer's two halves (llama_decode_attention, then
// llama_decode_mlp, or a mixture's mixture_mlp over the experts the rank holds) with
// the float32 all-reduce of their partial sums between them made
// here by shm::all_reduce, as ShmGroup.all_reduce makes it (the same copy, counters and
// sum in rank order: the result is the per-layer path's bit for bit), then Gemma's norm
// after the MLP. What it saves is the Python of two layer calls and two collectives a
// layer. ``shm``: the segment's two data buffers as float32 [2, ranks, slot floats];
// ``state``: (first layer, phase, collectives done). A wait that runs past spin_us
// returns to the caller instead of spinning on, so that the caller can check that its
// peers are alive (never a hang): the call then returns the pending tensor as its first
// output, with the state to go on from, and the caller calls again with them (phase 1:
// the attention's sum pending, 2: the MLP's), which completes that all-reduce without
// posting it again. Returns (output, stream, int64 [next layer, phase, collectives done,
// nanoseconds spent in the all-reduces]); next layer == layers when done.
std::vector<torch::Tensor> llama_decode_stack_ranked(
    torch::Tensor h, torch::Tensor residual, pybind11::list layers, std::vector<int64_t> windows,
    std::vector<torch::Tensor> positions, std::vector<torch::Tensor> cos_sin,
    torch::Tensor kv_cache, torch::Tensor slots, torch::Tensor block_tables,
    torch::Tensor context_lens, torch::Tensor row_starts, torch::Tensor shm,
    torch::Tensor counters, int64_t stride, int64_t rank, std::vector<int64_t> state,
    int64_t spin_us) {
  const int64_t count = static_cast<int64_t>(layers.size());
  TORCH_CHECK(state.size() == 3 && state[0] >= 0 && state[0] < count && state[1] >= 0 &&
              state[1] <= 2, "state: (layer, phase 0-2, collectives)");
  TORCH_CHECK(shm.scalar_type() == torch::kFloat && shm.dim() == 3 && shm.size(0) == 2,
              "shm: float32 [2, ranks, slot]");
  TORCH_CHECK(h.numel() <= shm.size(2), "a layer's output must fit one slot");
  const std::vector<StackLayer> stack = stack_layers(layers, windows, positions, cos_sin);
  int64_t layer = state[0], phase = state[1], sequence = state[2];
  std::chrono::steady_clock::duration reducing{};
  // The all-reduce of ``t`` as collective ``sequence`` (posting it first unless it is
  // being completed); false: the wait ran out.
  auto reduce = [&](torch::Tensor& t, bool post) {
    const auto started = std::chrono::steady_clock::now();
    if (post) ++sequence;
    torch::Tensor slots_now = shm.select(0, sequence % 2).narrow(1, 0, t.numel());
    const bool done = shm::all_reduce(t, slots_now, counters, stride, rank, sequence, spin_us, post);
    reducing += std::chrono::steady_clock::now() - started;
    return done;
  };
  bool waiting = false;
  {
    pybind11::gil_scoped_release released;
    // phase 1 / 2 on entry: h is the pending sum, posted by an earlier call
    bool post = phase == 0;
    for (; layer < count; ++layer, phase = 0, post = true) {
      const DenseLayer& d = stack[layer].d;
      if (phase == 0) {
        auto attention = stack_attention(d, h, residual, kv_cache, slots, block_tables,
                                         context_lens, row_starts);
        h = attention[0];
        residual = attention[1];
        phase = 1;
      }
      if (phase == 1) {
        if (!reduce(h, post)) { waiting = true; break; }
        post = true;
        auto mlp = stack_mlp(stack[layer], h, residual);
        h = mlp[0];
        residual = mlp[1];
        phase = 2;
      }
      if (!reduce(h, post)) { waiting = true; break; }
      h = after_mlp(h, d.post_mlp_norm, d.eps);
    }
  }
  const int64_t nanoseconds =
      std::chrono::duration_cast<std::chrono::nanoseconds>(reducing).count();
  torch::Tensor status = torch::tensor({waiting ? layer : count, waiting ? phase : 0, sequence,
                                        nanoseconds}, torch::kLong);
  return {h, residual, status};
}
