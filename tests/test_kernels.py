"""tandem's CPU kernels against the torch ops they replace (the same layers with the
kernels off), in float32 and bfloat16, on the strided views the model passes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cpu as cpu_kernels
from tandem.models.config import RopeConfig
from tandem.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from tandem.models.linear import Linear
from tandem.runner.linear.cpu_small_batch import CpuSmallBatchLinearMethod

pytestmark = [
    pytest.mark.skipif(cpu_kernels.load() is None, reason="no compiler here"),
    pytest.mark.usefixtures("two_threads"),
]

DTYPES = [torch.float32, torch.bfloat16]
# bfloat16: the kernels round where torch rounds, so they differ only where float32
# math differs by an ulp before a rounding (then by one bfloat16 ulp, 2**-8 relative).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0, rtol=2**-7)}


def both_paths(fn):
    """fn() with the kernels (inference) and with torch ops (autograd on, no grads)."""
    with torch.inference_mode():
        kernel = fn()
    with torch.enable_grad():
        reference = fn()
    return kernel, reference


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(7, 96, dtype=dtype)
    residual = torch.randn(7, 96, dtype=dtype)
    assert_close(*both_paths(lambda: norm(x)), dtype)
    (k_out, k_sum), (r_out, r_sum) = both_paths(lambda: norm(x, residual.clone()))
    assert_close(k_sum, r_sum, dtype)
    assert_close(k_out, r_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [32, 16])  # whole head, and partial rotary
def test_rotary_in_place_on_strided_views(dtype, rotary_dim):
    torch.manual_seed(0)
    heads, kv_heads, head_dim, tokens = 6, 2, 32, 5
    rotary = RotaryEmbedding(RopeConfig(10000.0, rotary_dim, None, {}), 2048)
    positions = torch.tensor([0, 3, 17, 1000, 4095])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)

    def rotate():
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        q, k, _ = qkv.clone().split(sizes, dim=-1)
        q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
        return rotary.rotate(q, k, rotary.prepare(positions, dtype))

    (kq, kk), (rq, rk) = both_paths(rotate)
    assert_close(kq, rq, dtype)
    assert_close(kk, rk, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(9, 2 * 48, dtype=dtype) * 3
    assert_close(*both_paths(lambda: silu_and_mul(x)), dtype)
    # Gates far out (under -ffast-math a gate under -88 made NaN, where silu is -0).
    x[0, :8] = torch.tensor([-945.0, -89.0, -88.0, 88.0, 945.0, -1e30, 1e30, 0.0])
    kernel, reference = both_paths(lambda: silu_and_mul(x))
    assert torch.isfinite(kernel).all()
    torch.testing.assert_close(kernel.float(), reference.float(), rtol=1e-2, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 96), (37, 40), (8, 7)])
def test_small_linear_matches_torch(dtype, rows, out_features, in_features):
    """Every tile shape: whole tiles of four rows and a remainder, K a multiple of the
    vector width and not, with and without bias."""
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=True).to(dtype)
    layer.method = CpuSmallBatchLinearMethod(dtype)
    x = torch.randn(rows, in_features, dtype=dtype)
    with torch.inference_mode():
        got = layer(x)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    # Both round the float32 sum once to the output dtype.
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("vocab", [5, 32, 4099, 49152])
def test_grammar_masks_match_the_exact_bit_test(vocab):
    """The kernel clears exactly the tokens whose bit is 0, in the listed rows only."""
    from tandem.runner.grammar_masks import apply_masks

    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    words = (vocab + 31) // 32
    masks = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32)
    masks[1] = -1  # everything allowed
    masks[2, words // 2 :] = 0
    rows = [4, 0, 2]
    expected = logits.clone()
    for mask, row in zip(masks.tolist(), rows, strict=True):
        for token in range(vocab):
            if not (mask[token // 32] >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    with torch.inference_mode():
        got = logits.clone()
        apply_masks(got, masks, rows)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("vocab", [1, 7, 49152, 4099])
def test_argmax_rows_matches_torch_ties_included(vocab):
    from tandem.runner.sampler import argmax_rows

    torch.manual_seed(0)
    logits = torch.randn(9, vocab)
    logits[0] = 1.0  # all tied: the first index wins
    logits[1, vocab // 2 :] = 50.0  # a tie between a later and an earlier lane
    logits[2, -1] = 100.0  # the maximum in the tail past the vector lanes
    with torch.inference_mode():
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
        assert torch.equal(argmax_rows(logits[:, : max(1, vocab - 3)]),
                           logits[:, : max(1, vocab - 3)].argmax(dim=-1))  # fmt: skip


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize(("experts", "top_k"), [(128, 8), (8, 2), (5, 5), (60, 4)])
def test_the_routers_picks_are_the_exact_maths(experts, top_k, normalize):
    """moe_route: the softmax in float64, its k largest in descending order (the lower
    expert first among equal ones), renormalized over the k or not; a row's picks the
    same alone as in a batch; float32 and bfloat16 logits."""
    torch.manual_seed(experts + top_k)
    logits = torch.randn(33, experts) * 3
    logits[0] = 0.5  # every expert tied: the first k
    logits[1] = -5.0
    logits[1, ::2] = 2.0  # ties among the largest, and among the rest
    route = cpu_kernels.load().moe_route
    for dtype in DTYPES:
        x = logits.to(dtype)
        weights, ids = route(x, top_k, normalize)
        probs = torch.softmax(x.double(), dim=-1)
        for row in range(x.size(0)):
            expected = sorted(range(experts), key=lambda e: (-probs[row, e].item(), e))[:top_k]
            assert ids[row].tolist() == expected
            picked = probs[row, expected]
            if normalize:
                picked = picked / picked.sum()
            torch.testing.assert_close(weights[row].double(), picked, atol=1e-6, rtol=1e-5)
        alone = route(x[5:6], top_k, normalize)
        assert torch.equal(alone[0], weights[5:6]) and torch.equal(alone[1], ids[5:6])
    with pytest.raises(RuntimeError, match="top_k"):
        route(logits, experts + 1, normalize)


def test_a_long_chunks_mlp_in_row_slices_equals_it_whole():
    """Inference runs a CPU MLP over more than MLP_ROWS rows a slice at a time (the
    last slice short); autograd runs it whole: the same rows."""
    from tandem.models.config import ModelConfig
    from tandem.models.llama import MLP_ROWS, GatedMLP

    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=0, hidden_size=64, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=64, intermediate_size=256,
        max_position_embeddings=0, norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=False, rope=None,
    )  # fmt: skip
    torch.manual_seed(0)
    mlp = GatedMLP(config)
    for parameter in mlp.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    x = torch.randn(2 * MLP_ROWS + 37, 64)
    sliced, whole = both_paths(lambda: mlp(x))
    torch.testing.assert_close(sliced, whole, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("lines", [1, 3, 40_000])  # one thread's share, and several
def test_the_read_probe_reads_every_word(lines):
    words = torch.randint(-(2**62), 2**62, (lines * 8,), dtype=torch.int64)
    expected = 0
    for word in words.tolist():
        expected ^= word
    assert cpu_kernels.load().read_stream(words) == expected
    with pytest.raises(RuntimeError, match="whole lines"):
        cpu_kernels.load().read_stream(words[:7])
