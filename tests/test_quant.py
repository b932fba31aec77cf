"""llama.cpp's block formats: the decoder against the gguf package's, the quantizers
against gguf's reference quantizers, and the integer-dot kernel against the exact math
(dequantized weights times the int8-per-block activations it multiplies), for every
format, odd shapes and batch sizes 1..64."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from tandem.kernels import cpu as cpu_kernels
from tandem.models.linear import Linear
from tandem.models.quantized import drop_float_weight, set_packed_part
from tandem.quant import packed as packed_module
from tandem.quant import split_blocks
from tandem.quant.blocks import BLOCK, GGMLType, decode, dequantize
from tandem.quant.blocks import FORMATS as FORMATS_TABLE
from tandem.quant.packed import (
    PackedWeight,
    kernels_read_compact,
    quantize_activations,
    reference,
)
from tandem.quant.quantize import FORMATS, quantize
from tandem.runner.linear.quantized import QuantizedLinearMethod

pytestmark = pytest.mark.usefixtures("two_threads")  # (conftest.py)

# The fp16 fields of each block (offsets in bytes), and the largest factor the rest of
# the block multiplies them by (|q - offset| times a sub-block scale): random blocks
# get scales that keep every weight within about +-0.1.
F16_FIELDS = {
    GGMLType.Q8_0: ((0,), 127),
    GGMLType.Q4_0: ((0,), 8),
    GGMLType.Q4_1: ((0, 2), 15),
    GGMLType.Q5_0: ((0,), 16),
    GGMLType.Q5_1: ((0, 2), 31),
    GGMLType.Q4_K: ((0, 2), 15 * 63),
    GGMLType.Q5_K: ((0, 2), 31 * 63),
    GGMLType.Q6_K: ((208,), 32 * 128),
    GGMLType.Q3_K: ((108,), 4 * 32),
    GGMLType.IQ4_NL: ((0,), 127),
    GGMLType.TQ2_0: ((64,), 2),
    GGMLType.TQ1_0: ((52,), 2),
    GGMLType.MXFP4: ((), 12),  # (its exponent byte: set below)
    GGMLType.IQ4_XS: ((0,), 127 * 32),
    GGMLType.Q2_K: ((80, 82), 3 * 15),
    GGMLType.IQ3_S: ((0,), 15 * 31),
    GGMLType.IQ3_XXS: ((0,), 62 * 31 / 4),
    GGMLType.IQ2_XXS: ((0,), 43 * 31 / 8),
    GGMLType.IQ2_XS: ((0,), 43 * 31 / 8),
    GGMLType.IQ2_S: ((0,), 43 * 31 / 8),
    GGMLType.IQ1_S: ((0,), 9 * 15 / 8),
    GGMLType.IQ1_M: ((), 9 * 15 / 8),  # (its d's bits: set below)
}


def random_blocks(code: GGMLType, rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """Random bytes in ``code``'s layout: every bit pattern is a valid block once its
    float16 scales are finite."""
    rng = np.random.default_rng(seed)
    per_block, nbytes = BLOCK[code]
    raw = rng.integers(0, 256, size=(rows, columns // per_block, nbytes), dtype=np.uint8)
    offsets, factor = F16_FIELDS[code]
    for offset in offsets:
        scale = rng.uniform(-0.1, 0.1, size=raw.shape[:2]) / factor
        scale = scale.astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    if code == GGMLType.MXFP4:  # powers of two 2**-15 .. 2**-7: weights within +-0.1
        raw[..., 0] = rng.integers(113, 122, size=raw.shape[:2], dtype=np.uint8)
    if code == GGMLType.IQ1_M:  # d's 16 bits: the top nibbles of its four u16 (48..55)
        d = (rng.uniform(-0.1, 0.1, size=raw.shape[:2]) / factor).astype(np.float16)
        for k in range(4):
            nibble = ((d.view(np.uint16) >> (4 * k)) & 0x0F).astype(np.uint8)
            raw[..., 49 + 2 * k] = (raw[..., 49 + 2 * k] & 0x0F) | (nibble << 4)
    return torch.from_numpy(raw.reshape(rows, -1))


@pytest.mark.parametrize("code", list(BLOCK), ids=lambda c: c.name)
def test_the_decoder_equals_the_gguf_package(code):
    raw = random_blocks(code, 5, 512)
    ours = dequantize(code, raw, 512).numpy()
    theirs = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(int(code)))
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_the_quantizers_write_llama_cpps_reference_bytes(fmt):
    code = FORMATS[fmt]
    w = torch.randn(6, 256) * torch.logspace(-2, 1, 6).unsqueeze(1)
    expected = quants.quantize(w.numpy(), gguf.GGMLQuantizationType(int(code)))
    np.testing.assert_array_equal(quantize(w, code).numpy(), expected)


LLAMA_CPP_BYTES = Path(__file__).with_name("reference") / "llama_cpp_quantized.npz"


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("fmt", ["q3_k", "q2_k", "iq4_nl", "iq4_xs", "mxfp4"])
def test_the_low_bit_quantizers_write_llama_cpps_bytes(fmt, path, monkeypatch):
    """Against llama.cpp's own bytes for the same float16 weights (ggml_quantize_chunk,
    as llama-quantize calls it without an importance matrix: tests/reference, written
    by ``python -m benchmarks.quantizer_agreement --write-fixture``): heavy-tailed rows
    from 1e-3 to 10, a zero half row, a constant one. Nearly every block is llama.cpp's
    byte for byte; where a last-bit difference in a sum chose another of two close
    candidates, the weights are as close to the input as llama.cpp's."""
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "available", lambda device, dtype: False)
    elif not cpu_kernels.available(torch.device("cpu"), torch.float32):
        pytest.skip("the CPU kernels could not be built here")
    reference = np.load(LLAMA_CPP_BYTES)
    w = torch.from_numpy(reference["weights"]).float()
    kind = gguf.GGMLQuantizationType[fmt.upper()]
    _, nbytes = gguf.GGML_QUANT_SIZES[kind]
    ours, theirs = quantize(w, FORMATS[fmt]).numpy(), reference[fmt]
    assert ours.shape == theirs.shape
    same = (ours.reshape(-1, nbytes) == theirs.reshape(-1, nbytes)).all(-1)
    assert same.mean() >= 0.95, same.mean()

    def error(raw):
        return ((quants.dequantize(raw, kind) - w.double().numpy()) ** 2).sum()

    assert error(ours) <= 1.01 * error(theirs)


def test_q4_k_is_a_valid_block_stream_close_to_the_weights():
    w = torch.randn(8, 512)
    raw = quantize(w, GGMLType.Q4_K)
    ours = dequantize(GGMLType.Q4_K, raw, 512)
    theirs = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(ours.numpy(), theirs)
    relative = (ours - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
    assert relative < 0.09  # 4 bits a weight: Q4_0 on the same weights gives ~0.086


@pytest.mark.parametrize("code", list(BLOCK), ids=lambda c: c.name)
def test_packing_keeps_every_weight(code, monkeypatch):
    raw = random_blocks(code, 13, 256)  # 13 rows: the last tile is padded
    packed = PackedWeight.from_ggml(code, raw, 256)
    dense = dequantize(code, raw, 256)
    torch.testing.assert_close(packed.dequantize(), dense, rtol=1e-6, atol=1e-7)
    index = torch.tensor([12, 0, 5, 5, 8])
    # Embedding lookups: the compiled kernel, and torch without it.
    torch.testing.assert_close(packed.dequantize_rows(index), dense[index], rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(cpu_kernels, "available", lambda device, dtype: False)
    torch.testing.assert_close(packed.dequantize_rows(index), dense[index], rtol=1e-6, atol=1e-7)


needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(torch.device("cpu"), torch.float32),
    reason="the CPU kernels could not be built here",
)


@needs_kernels
@pytest.mark.parametrize("code", list(BLOCK), ids=lambda c: c.name)
def test_the_compiled_packer_writes_the_python_packers_bytes(code, monkeypatch):
    """pack_ops.cpp against packed.py's torch path (PackedWeight.from_decoded on the
    decoded values; the codebook types' blocks tiled): every byte of values, scales and
    constants, their dtypes, padding rows; rows read strided from a wider buffer; and a
    matrix packed from two tensors at a tile boundary (q and k into one fused layer)
    equals it packed at once."""
    raw = random_blocks(code, 37, 512, seed=int(code))
    with monkeypatch.context() as torch_only:
        torch_only.setattr(packed_module, "compiled_packer", lambda raw: False)
        expected = PackedWeight.from_ggml(code, raw, 512)
    wide = torch.cat([raw, torch.zeros(37, 8, dtype=torch.uint8)], dim=1)[:, : raw.shape[1]]
    for source in (raw, wide):
        packed = PackedWeight.from_ggml(code, source, 512)
        for name in ("values", "scales", "corr"):
            ours, theirs = getattr(packed, name), getattr(expected, name)
            assert (ours is None) == (theirs is None), name
            if ours is not None:
                assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
        assert (packed.rows, packed.group, packed.offset, packed.source) == (
            expected.rows, expected.group, expected.offset, expected.source
        )  # fmt: skip
    joint = PackedWeight.allocate(code, 37, 512)
    joint.fill_rows(0, code, raw[:16])
    joint.fill_rows(16, code, raw[16:])
    assert torch.equal(joint.values, expected.values) and torch.equal(joint.scales, expected.scales)
    with pytest.raises(ValueError):
        joint.fill_rows(8, code, raw[:8])  # not on a tile boundary


@needs_kernels
@pytest.mark.parametrize("code", list(BLOCK), ids=lambda c: c.name)
@pytest.mark.parametrize("rows, columns", [(7, 256), (40, 768), (3, 512)])
def test_the_kernel_equals_the_exact_math(code, rows, columns):
    packed = PackedWeight.from_ggml(code, random_blocks(code, rows, columns, seed=rows), columns)
    bias = torch.randn(rows)
    for batch in (1, 2, 3, 4, 5, 7, 9, 15, 16, 33, 64):  # 15: 8 + 4 + 3 tokens a pass
        x = torch.randn(batch, columns) * 3
        x[0, :32] = 0  # an all-zero activation block (scale 0)
        out = torch.full((batch, rows + 5), float("nan"))[:, 2 : 2 + rows]  # strided rows
        packed.matmul(x, out, bias)
        expected = reference(packed, x) + bias.double()
        scale = expected.abs().max().item()
        assert (out.double() - expected).abs().max().item() <= 1e-5 * scale, (batch, code)


COMPACT_FORMATS = [code for code, spec in FORMATS_TABLE.items() if spec.compact_bits]


@needs_kernels
@pytest.mark.parametrize("code", COMPACT_FORMATS, ids=lambda c: c.name)
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "wide"])
def test_the_compact_formats_run_in_either_layout(code, compact, monkeypatch):
    """IQ4_NL, IQ4_XS and MXFP4 as their 4-bit indices, looked up by the kernel's byte
    shuffle, Q2_K and the ternary types as 2-bit values, Q3_K as 3 (where the build reads
    compact layouts: the AVX2 and portable paths); or as int8 levels and nibbles (the
    AVX-512 paths' layouts, forced here): the file's weights either way, and the kernel
    the exact math, embedding lookups included."""
    if compact and not kernels_read_compact():
        pytest.skip("this build reads no compact layouts (its AVX-512 paths)")
    monkeypatch.setattr(packed_module, "kernels_read_compact", lambda: compact)
    spec = FORMATS_TABLE[code]
    raw = random_blocks(code, 40, 768, seed=5)
    packed = PackedWeight.from_ggml(code, raw, 768)
    assert packed.table == (spec.table if compact else 0)
    assert packed.bits == (spec.compact_bits if compact else spec.packed_bits)
    dense = dequantize(code, raw, 768)
    assert torch.equal(packed.dequantize(), dense)
    from_decoder = PackedWeight.from_decoded(decode(code, raw, 768), code.name)
    assert torch.equal(from_decoder.values, packed.values)  # the compiled packer's bytes
    index = torch.tensor([39, 0, 17])
    torch.testing.assert_close(packed.dequantize_rows(index), dense[index], rtol=0, atol=0)
    for batch in (1, 2, 3, 5, 16, 33):
        x = torch.randn(batch, 768) * 3
        out = torch.empty(batch, 40)
        packed.matmul(x, out)
        expected = reference(packed, x)
        scale = expected.abs().max().item()
        assert (out.double() - expected).abs().max().item() <= 1e-5 * scale, batch


@needs_kernels
def test_whether_the_kernels_read_compact_layouts_is_known_before_they_are_built(monkeypatch):
    """The CPU's flags tell what the build says (the planner prices a file's compact
    formats without compiling anything)."""
    built = bool(cpu_kernels.load().compact_layouts())
    assert cpu_kernels.reads_compact_layouts() == built
    monkeypatch.setattr(cpu_kernels.load, "cache_info", lambda: type("I", (), {"currsize": 0}))
    assert cpu_kernels.reads_compact_layouts() == built


@needs_kernels
def test_the_kernel_takes_only_a_power_of_two_beside_the_scales():
    """The codebook types' d / 8 is a factor each output takes (exact, so a token's
    result stays its own whatever its batch); anything else is refused."""
    packed = PackedWeight.from_ggml(GGMLType.IQ2_XXS, random_blocks(GGMLType.IQ2_XXS, 16, 256), 256)
    assert packed.factor == 0.125
    x, out = torch.randn(3, 256), torch.empty(3, 16)
    kernel = cpu_kernels.load().quant_linear
    for factor in (0.3, 2.0, 0.0, 2.0**-9):
        with pytest.raises(RuntimeError, match="power of two"):
            args = (packed.values, packed.scales, None, None, 16, 16, 0.0, factor, packed.table)
            kernel(out, x, *args)
    kernel(out, x, packed.values, packed.scales, None, None, 16, 16, 0.0, 1.0, packed.table)
    torch.testing.assert_close(out * 0.125, reference(packed, x).float(), rtol=1e-5, atol=1e-5)


CODEBOOKS = [code for code in BLOCK if FORMATS_TABLE[code].codebook]


@needs_kernels
@pytest.mark.parametrize("code", CODEBOOKS, ids=lambda c: c.name)
def test_a_codebook_type_held_as_its_blocks_multiplies_as_its_int8_values(code):
    """The codebook types are held as the file's blocks and each tile is decoded as it
    is multiplied (quant_ops.cpp's expand_codebook): the same products, bit for bit, as
    their values decoded once into int8 under records (PackedWeight.from_decoded), at
    every batch size, and the same rows looked up. The kernels keep the first grid they
    are given for a type and refuse another."""
    raw = random_blocks(code, 40, 768, seed=int(code))
    blocks = PackedWeight.from_ggml(code, raw, 768)
    values = PackedWeight.from_decoded(decode(code, raw, 768), code.name)
    assert blocks.codebook == code and values.codebook is None
    assert blocks.nbytes == raw.numel() + (-40 % 16) * raw.shape[1]  # the file's, padded
    for batch in (1, 3, 16, 70):
        x = torch.randn(batch, 768)
        ours, theirs = torch.empty(batch, 40), torch.empty(batch, 40)
        blocks.matmul(x, ours)
        values.matmul(x, theirs)
        assert torch.equal(ours, theirs), batch
    index = torch.tensor([0, 17, 39, 17])
    assert torch.equal(blocks.dequantize_rows(index), values.dequantize_rows(index))
    assert torch.equal(blocks.dequantize(), values.dequantize())
    grid = packed_module.grid(code)
    cpu_kernels.load().set_codebook_grid(int(code), grid.clone())  # the same: taken
    with pytest.raises(RuntimeError, match="a different grid"):
        cpu_kernels.load().set_codebook_grid(int(code), -grid)


# A block of activations (found by random search) whose value 0x1.fc6aeep-1 times the
# block's 1 / d is exactly 16.5 in float32: the reference rounds it to 16.
HALFWAY_BLOCK = [
    "-0x1.592cc2p-1", "0x1.7b76e2p+2", "-0x1.673bf8p-5", "-0x1.76c53p+1", "0x1.7afe0cp-1",
    "0x1.cc6edep+1", "0x1.fe8ceep+0", "0x1.2e539cp+1", "-0x1.92864cp+0", "0x1.02595p+2",
    "-0x1.30ce2ap-1", "0x1.c5ba24p+1", "-0x1.0d77acp+1", "0x1.beac24p+1", "-0x1.d41368p-1",
    "0x1.c9ea86p-1", "-0x1.cb06p+1", "-0x1.2d0e7p+1", "0x1.fc6aeep-1", "-0x1.2daf58p+1",
    "0x1.cf88d6p-2", "-0x1.9db25ap-1", "-0x1.037216p+1", "0x1.806726p+1", "-0x1.4195bp+0",
    "-0x1.3ab94ep+0", "-0x1.911b6cp+1", "-0x1.d2a03ap+1", "0x1.c94694p+1", "0x1.0e3c3cp+2",
    "-0x1.d403b4p+1", "0x1.e928d0p+2",
]  # fmt: skip


@needs_kernels
def test_an_activation_exactly_halfway_rounds_to_even():
    """Every instruction-set path quantizes as the reference does (the scalar one,
    written in plain C++, was compiled under -ffast-math to round this block's 16.5 up)."""
    raw = random_blocks(GGMLType.Q8_0, 16, 32, seed=3)
    packed = PackedWeight.from_ggml(GGMLType.Q8_0, raw, 32)
    x = torch.tensor([[float.fromhex(v) for v in HALFWAY_BLOCK]])
    out = torch.empty(1, 16)
    packed.matmul(x, out)
    expected = reference(packed, x)
    assert (out.double() - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


@needs_kernels
@pytest.mark.parametrize("code", list(BLOCK), ids=lambda c: c.name)
def test_a_token_gets_the_same_result_whatever_its_batch(code):
    """Each token's activations are quantized alone and its sums run in the same order,
    so batching (chunked prefill, speculation) cannot change a token's result, whichever
    of the kernel's instances (tokens at a time, rows at a time) computed it."""
    packed = PackedWeight.from_ggml(code, random_blocks(code, 64, 512), 512)
    x = torch.randn(37, 512)
    whole = torch.empty(37, 64)
    packed.matmul(x, whole)
    for i in (0, 5, 25):
        for batch in (1, 2, 3, 4, 7, 8, 12):
            part = torch.empty(batch, 64)
            packed.matmul(x[i : i + batch].clone(), part)
            assert torch.equal(part[0], whole[i]), (i, batch)


@needs_kernels
@pytest.mark.parametrize("code", list(BLOCK), ids=lambda c: c.name)
def test_the_tile_registers_give_the_vector_paths_bits(code):
    """On CPUs with AMX, passes of 16 tokens take the tile registers (quant_ops.cpp):
    the same integer sums and the same float steps as the vector path, so every token's
    result is the same bits either way: whole passes of 16, a remainder of fewer, and
    several chunks of 64 tokens, over several tiles with a padded last one."""
    module = cpu_kernels.load()
    was = module.amx_mode(-1)
    if not module.amx_mode(1):
        pytest.skip("no AMX tiles on this CPU (or the kernel does not grant them)")
    try:
        packed = PackedWeight.from_ggml(code, random_blocks(code, 40, 768, seed=7), 768)
        bias = torch.randn(40)
        for batch in (16, 37, 120, 130):  # 120: chunks of 64 and 56 (3 x 16 + 8)
            x = torch.randn(batch, 768) * 3
            x[3, 32:64] = 0  # an all-zero activation block (scale 0)
            tiles, vector = torch.empty(batch, 40), torch.empty(batch, 40)
            module.amx_mode(1)
            packed.matmul(x, tiles, bias)
            module.amx_mode(0)
            packed.matmul(x, vector, bias)
            assert torch.equal(tiles, vector), (code, batch)
    finally:
        module.amx_mode(int(was))


@needs_kernels
def test_a_fused_layer_of_parts_in_different_formats():
    """q, k and v of one fused layer may be stored in different formats (a Q4_K_M file
    keeps v in Q6_K): parts of one format are joined, the others run on their own."""
    layer = Linear(256, 16 + 8 + 8 + 5, bias=True)
    parts = [(0, GGMLType.Q4_1, 16), (16, GGMLType.Q4_1, 8), (24, GGMLType.Q6_K, 8),
             (32, GGMLType.Q8_0, 5)]  # fmt: skip
    dense = []
    for start, code, rows in parts:
        raw = random_blocks(code, rows, 256, seed=start)
        set_packed_part(layer, start, PackedWeight.from_ggml(code, raw, 256))
        dense.append(dequantize(code, raw, 256))
    drop_float_weight(layer)
    method = QuantizedLinearMethod()
    method.process_weights_after_loading(layer)
    assert len(layer.packed_parts) == 3  # the two Q4_1 parts are one matrix
    layer.method = method
    x = torch.randn(3, 256)
    with torch.no_grad():
        out = layer(x)
    expected = quantize_activations(x) @ torch.cat(dense).double().T + layer.bias.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_packed_weights_take_the_files_bits():
    """Values keep the file's bits (Q5's 5 and Q6_K's 6 as nibbles plus planes of the
    high bits, not a byte each); Q4_1's scales and minimums stay float16 as in the
    file; Q4_0's offset (-8 * d) is not stored at all; the K formats keep the file's
    float16 super-scales and 8-bit sub-scales (Q4_K: 4.625 bits against the file's
    4.5); where the kernels read compact layouts, IQ4_NL, IQ4_XS and MXFP4 keep their
    4-bit indices, Q2_K and the ternary types 2 bits, Q3_K 3; and every weight is the
    file's."""
    compact = kernels_read_compact()
    sizes = {}
    for code in BLOCK:
        raw = random_blocks(code, 32, 512)
        packed = PackedWeight.from_ggml(code, raw, 512)
        sizes[code] = packed.nbytes * 8 / (32 * 512)
        assert torch.equal(packed.dequantize(), dequantize(code, raw, 512)), code
    assert sizes == {
        GGMLType.Q4_0: 4.5, GGMLType.Q4_1: 5.0, GGMLType.Q5_0: 5.5, GGMLType.Q5_1: 6.0,
        GGMLType.Q8_0: 8.5, GGMLType.Q4_K: 4.625, GGMLType.Q5_K: 5.625, GGMLType.Q6_K: 6.5625,
        GGMLType.Q3_K: 3.5625 if compact else 4.5625,  # (3 bits, Q6_K's records; or nibbles)
        GGMLType.IQ4_NL: 4.5 if compact else 8.5,  # (its indices; or levels as int8, Q8_0's)
        GGMLType.TQ2_0: 2.5625 if compact else 4.5625,  # (2 bits, Q3_K's records; or nibbles)
        GGMLType.TQ1_0: 2.5625 if compact else 4.5625,  # (TQ2_0's: its base-3 values as 2 bits)
        GGMLType.MXFP4: 4.5 if compact else 5.5,  # (indices; or its values + 16 as Q5_0's)
        GGMLType.IQ4_XS: 4.5625 if compact else 8.5625,  # (or its levels as int8)
        GGMLType.Q2_K: 2.625 if compact else 4.625,  # (2 bits, records with minimums)
        # (the codebook types as the file's blocks, decoded a tile at a time)
        **{code: BLOCK[code][1] * 8 / 256 for code in BLOCK if FORMATS_TABLE[code].codebook},
    }  # fmt: skip


@pytest.mark.parametrize("code", list(BLOCK), ids=lambda c: c.name)
def test_the_gpus_split_blocks_keep_every_weight_at_the_files_bits(code, monkeypatch):
    """The layout the GPU kernels read (quant/split_blocks.py; runner/linear/
    triton_blocks.py multiplies it, tests/test_cuda.py checks that on a GPU or in
    Triton's interpreter): every weight the file's, bit for bit, for every block
    format, at the file's bits (Q4_K and Q5_K: their 6-bit sub-scales a byte each);
    two parts of one format joined are the rows of both. The 6-row part is converted
    4 rows at a time, as a large matrix is (CONVERT_ROWS)."""
    monkeypatch.setattr(split_blocks, "CONVERT_ROWS", 4)
    columns = 512 + 256 * (BLOCK[code][0] == 256)  # not a power of two
    first, second = random_blocks(code, 6, columns, seed=1), random_blocks(code, 3, columns)
    cpu = torch.device("cpu")
    weights = [split_blocks.from_ggml(code, raw, columns, cpu) for raw in (first, second)]
    assert torch.equal(weights[0].dequantize(torch.float32), dequantize(code, first, columns))
    (start, joined), = split_blocks.join([(0, weights[0]), (6, weights[1])])  # fmt: skip
    expected = torch.cat([dequantize(code, raw, columns) for raw in (first, second)])
    assert start == 0 and torch.equal(joined.dequantize(torch.float32), expected)
    bits = weights[0].nbytes * 8 / (6 * columns)
    wider = {GGMLType.Q4_K: 4.625 / 4.5, GGMLType.Q5_K: 5.625 / 5.5,
             GGMLType.Q3_K: 4.5625 / 3.4375, GGMLType.IQ4_NL: 8.5 / 4.5,
             GGMLType.TQ2_0: 4.5625 / 2.0625, GGMLType.TQ1_0: 4.5625 / 1.6875,
             GGMLType.MXFP4: 5.5 / 4.25,
             GGMLType.IQ4_XS: 8.5625 / 4.25,
             GGMLType.Q2_K: 5.125 / 2.625,
             GGMLType.IQ3_S: 8.5625 / 3.4375}.get(code, 1.0)  # fmt: skip
    if FORMATS_TABLE[code].factor != 1:  # (d times its power of two as float32: 2 bytes more)
        wider = (8.5 + 32 / 256) / (BLOCK[code][1] * 8 / BLOCK[code][0])
    assert bits == pytest.approx(BLOCK[code][1] * 8 / BLOCK[code][0] * wider)


def test_the_gpu_keeps_a_matrix_in_blocks_where_its_kernels_read_it():
    """Q4_0 / Q8_0 matrices of any width; the other formats in whole 64-weight chunks
    (a Q5_0 matrix of 640 columns, as Gemma 3 270M's file holds, but not one of 96);
    float matrices are not blocks. Parts of two formats stay apart."""
    keeps = split_blocks.kept_in_blocks
    assert keeps(GGMLType.Q4_0, 96) and keeps(GGMLType.Q8_0, 96)
    assert keeps(GGMLType.Q5_0, 640) and keeps(GGMLType.Q6_K, 512)
    assert not keeps(GGMLType.Q5_0, 96) and not keeps(GGMLType.F16, 512)
    parts = []
    for start, code, rows in [(0, GGMLType.Q5_0, 4), (4, GGMLType.Q8_0, 2), (6, GGMLType.Q8_0, 2)]:
        raw = random_blocks(code, rows, 256, seed=start)
        parts.append((start, split_blocks.from_ggml(code, raw, 256, torch.device("cpu"))))
    assert [(start, w.rows) for start, w in split_blocks.join(parts)] == [(0, 4), (4, 4)]


# -- the one table of block formats ------------------------------------------------------


def test_the_format_table_agrees_with_gguf_and_the_cpp_packer():
    """blocks.FORMATS is the one row a format has: its sizes are gguf-py's, and the C++
    packer (kernels/pack_ops.cpp) knows every format's code, packed and compact bits
    and record size; the codebook types, whose blocks it copies, have codebook_ops.cpp's
    block bytes and grid shapes."""
    import re
    from pathlib import Path

    from tandem.quant.blocks import FORMATS

    for code, spec in FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(code))] == (
            spec.weights, spec.nbytes
        ), code.name  # fmt: skip
    source = (Path(cpu_kernels.__file__).parent / "pack_ops.cpp").read_text()
    enum = re.search(r"enum Code : int64_t \{([^}]*)\}", source).group(1)
    cpp_codes = {name.strip(): int(value) for name, value in
                 (item.split("=") for item in enum.split(","))}  # fmt: skip
    compiled = FORMATS
    assert cpp_codes == {code.name: int(code) for code in compiled}  # every format
    body = re.search(r"inline int value_bits\(int64_t code\) \{(.*?)\n\}", source, re.S).group(1)
    cpp_bits = {}
    for cases, bits in re.findall(r"((?:case \w+: )+)return (\d+);", body):
        cpp_bits.update({name: int(bits) for name in re.findall(r"case (\w+):", cases)})
    default = int(re.search(r"default: return (\d+);", body).group(1))
    codebooks = (Path(cpu_kernels.__file__).parent / "codebook_ops.cpp").read_text()
    shapes = re.findall(r"case (\w+): return \{(\d+), (\d+), (\d+)\};", codebooks)
    assert {name: tuple(map(int, shape)) for name, *shape in shapes} == {
        code.name: (spec.nbytes, *packed_module.grid(code).shape)
        for code, spec in compiled.items() if spec.codebook
    }  # fmt: skip
    compiled = {code: spec for code, spec in FORMATS.items() if not spec.codebook}
    for code, spec in compiled.items():
        assert cpp_bits.get(code.name, default) == spec.packed_bits, code.name
    body = re.search(r"inline int compact_bits\(int64_t code\) \{(.*?)\n\}", source, re.S).group(1)
    cpp_compact = {}
    for cases, bits in re.findall(r"((?:case \w+: )+)return (\d+);", body):
        cpp_compact.update({name: int(bits) for name in re.findall(r"case (\w+):", cases)})
    assert cpp_compact == {code.name: spec.compact_bits for code, spec in compiled.items()
                           if spec.compact_bits}  # fmt: skip
    body = re.search(r"inline int64_t record_bytes\(int64_t code\) \{(.*?)\n\}", source, re.S)
    cpp_records = {}
    for cases, size in re.findall(r"((?:case \w+: )+)return (\d+);", body.group(1)):
        cpp_records.update({name: int(size) for name in re.findall(r"case (\w+):", cases)})
    for code, spec in compiled.items():
        assert cpp_records.get(code.name, 0) == spec.record_bytes, code.name
    # The tables 4-bit values index: quant_ops.cpp's kTables rows are TABLES' entries.
    from tandem.quant.blocks import TABLES

    kernels = (Path(cpu_kernels.__file__).parent / "quant_ops.cpp").read_text()
    rows = re.search(r"kTables\[2\]\[16\] = \{(.*?)\};", kernels, re.S).group(1)
    cpp_tables = [[int(v) for v in row.split(",")] for row in re.findall(r"\{([^}]*)\}", rows)]
    assert cpp_tables == [TABLES[1].tolist(), TABLES[2].tolist()]
