"""Format decoders checked bit for bit against the formats' definitions and independent encoders.

Element decoders: every code of e4m3 (256), e2m1 (16) and e8m0 (256) against the value tables of
docs/models.md §4.5-4.6 and against ml_dtypes (NVFP4 scales: every e4m3 byte, NaN codes included).
Weight decoders: against encoders written from the spec (the compressed-tensors INT4 library itself
is checked by the INT4 golden fixtures).
"""

import ml_dtypes
import numpy as np
import pytest

from jaxdsa.checkpoints.quant import (
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    dequantize_fp4,
    dequantize_fp8_block,
    dequantize_int4_packed,
    dequantize_nvfp4,
    unpack_fp4,
)


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal as float32 bit patterns, except that any NaN equals any NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_e4m3_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    s, e, m = (codes.astype(int) >> 7), (codes.astype(int) >> 3) & 15, codes.astype(int) & 7
    # docs/models.md §4.5: bias 7, exponent 0 subnormal, no infinities, S.1111.111 is NaN
    table = np.array(
        [
            (-1.0) ** si * (2.0 ** (ei - 7) * (1 + mi / 8) if ei else 2.0**-6 * mi / 8)
            for si, ei, mi in zip(s, e, m)
        ]
    )
    table[(codes & 0x7F) == 0x7F] = np.nan
    got = decode_e4m3(codes)
    _same_bits(got, table)
    _same_bits(got, codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert np.signbit(got[0x80]) and got[0x80] == 0  # -0 keeps its sign
    assert np.nanmax(got) == 448 and got[1] == 2.0**-9


def test_e2m1_all_codes():
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]  # docs/models.md §4.6
    codes = np.arange(16, dtype=np.uint8)
    got = decode_e2m1(codes)
    _same_bits(got, np.array(table))
    _same_bits(got, codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_e8m0_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    want = np.array([np.nan if e == 255 else 2.0 ** (int(e) - 127) for e in codes])
    got = decode_e8m0(codes)
    _same_bits(got, want)
    _same_bits(got, codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    _same_bits(decode_e8m0(codes.view(ml_dtypes.float8_e8m0fnu)), want)
    assert got[0] == 2.0**-127 and got[0] > 0  # a float32 subnormal, kept


@pytest.mark.parametrize("scale_kind", ["float32", "e8m0"])
def test_fp8_partial_edge_blocks_576_rows(scale_kind):
    """A 576-row weight in 128x128 blocks has 5 row blocks, the last one 64 rows (docs/models.md §4.5)."""
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, size=(576, 300)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    if scale_kind == "float32":
        scale = rng.uniform(1e-4, 1e-2, size=(5, 3)).astype(np.float32)  # not powers of two
        s32 = scale
    else:
        scale = rng.integers(100, 140, size=(5, 3)).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
        s32 = np.ldexp(np.float32(1), scale.view(np.uint8).astype(np.int32) - 127)
    got = dequantize_fp8_block(q, scale, (128, 128))
    rows, cols = np.meshgrid(np.arange(576), np.arange(300), indexing="ij")
    want = q.astype(np.float32) * s32[rows // 128, cols // 128]  # fp32(q) * s, in float32
    _same_bits(got, want)


def test_fp8_scale_shape_checked():
    q = np.zeros((576, 256), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"\(5, 2\)"):
        dequantize_fp8_block(q, np.ones((4, 2), np.float32), (128, 128))


def test_fp4_v4_experts():
    """Low nibble = even column, high nibble = odd column; one e8m0 scale per 32 columns."""
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, size=(3, 40, 96)).astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(np.int8)  # the checkpoint stores I8
    np.testing.assert_array_equal(unpack_fp4(packed), codes)
    e = rng.integers(110, 135, size=(3, 40, 3)).astype(np.uint8)
    got = dequantize_fp4(packed, e.view(ml_dtypes.float8_e8m0fnu))
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    _same_bits(got, values * np.ldexp(np.float32(1), np.repeat(e.astype(np.int32), 32, -1) - 127))


def test_nvfp4_every_code_and_scale_byte():
    """ModelOpt NVFP4 (docs/models.md §4.8): low nibble = even column; one e4m3 scale per 16 columns,
    here every one of the 256 bytes (0x7F / 0xFF NaN: their blocks decode to NaN); a float32 global
    scale that multiplies. Against ml_dtypes, in ModelOpt's order: ``fp32(s) * g`` rounded first."""
    rng = np.random.default_rng(3)
    out, inp = 64, 64  # 4 blocks a row: 256 scale bytes
    codes = rng.integers(0, 16, size=(out, inp)).astype(np.uint8)
    codes[0, :16] = np.arange(16)  # every e2m1 code
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = rng.permutation(256).astype(np.uint8).reshape(out, inp // 16)
    g = np.float32(6.4059207e-3)  # not a power of two: the products round
    got = dequantize_nvfp4(packed, scale.view(ml_dtypes.float8_e4m3fn), g)
    block = scale.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * g
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * np.repeat(block, 16, axis=1)
    _same_bits(got, want)
    np.testing.assert_array_equal(np.isnan(got), np.isin(scale, (0x7F, 0xFF)).repeat(16, axis=1))
    # the order matters: e2m1 * (s * g) is not always (e2m1 * s) * g
    s32 = np.repeat(scale.view(ml_dtypes.float8_e4m3fn).astype(np.float32), 16, axis=1)
    other = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * s32 * g
    assert np.any((got != other) & ~np.isnan(got))


def test_nvfp4_one_global_scale_per_expert():
    """A stack of experts ``[E, out, in / 2]`` with ``weight_scale_2`` per expert ``[E]``."""
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, size=(3, 8, 32)).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale = rng.integers(0x30, 0x50, size=(3, 8, 2)).astype(np.uint8)
    g = np.array([0.5, 3.0e-4, 7.0], np.float32)
    got = dequantize_nvfp4(packed, scale, g)
    for e in range(3):
        _same_bits(got[e], dequantize_nvfp4(packed[e], scale[e], g[e]))
    with pytest.raises(ValueError, match="weight_scale shape"):
        dequantize_nvfp4(packed, scale[..., :1], g)


def _pack_along(values: np.ndarray, axis: int) -> np.ndarray:
    """Spec encoder (docs/models.md §4.7): signed 4-bit values +8, eight per int32, element k at bits 4k."""
    v = np.moveaxis(values + 8, axis, -1).astype(np.uint32)
    pad = (-v.shape[-1]) % 8
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.uint32)], axis=-1)
    v = v.reshape(v.shape[:-1] + (-1, 8))
    words = np.zeros(v.shape[:-1], np.uint32)
    for k in range(8):
        words |= v[..., k] << np.uint32(4 * k)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("scale_dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_int4_pack_quantized_in_the_scale_dtype(symmetric, scale_dtype):
    """``(q - zp) * scale`` computed and rounded in the scale's dtype (compressed-tensors'
    ``_dequantize``), here as ml_dtypes / NumPy arithmetic in that dtype."""
    rng = np.random.default_rng(1)
    out, inp, group = 20, 70, 32  # neither dim a multiple of 8 or of the group
    groups = -(-inp // group)
    q = rng.integers(-8, 8, size=(out, inp))
    zp = np.zeros((out, groups), np.int64) if symmetric else rng.integers(-8, 8, size=(out, groups))
    scale = rng.uniform(0.01, 0.1, size=(out, groups)).astype(scale_dtype)
    per_col = lambda a: np.repeat(a, group, 1)[:, :inp]  # noqa: E731
    want = (q - per_col(zp)).astype(scale_dtype) * per_col(scale)
    got = dequantize_int4_packed(
        _pack_along(q, 1), scale, None if symmetric else _pack_along(zp, 0), (out, inp), group
    )
    assert got.dtype == np.dtype(scale_dtype)
    _same_bits(got, want)
    if scale_dtype == ml_dtypes.bfloat16:  # the float32 product is not the library's value
        f32 = (q - per_col(zp)) * per_col(scale.astype(np.float32))
        assert (got.astype(np.float32) != f32).mean() > 0.25
