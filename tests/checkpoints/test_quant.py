"""Dequantization formats checked against independent encoders written from the spec."""

import ml_dtypes
import numpy as np
import pytest

from checkpoints.quant import dequantize_fp8_block, dequantize_int4_packed


def test_fp8_partial_edge_blocks_576_rows():
    """A 576-row weight in 128x128 blocks has 5 row blocks, the last one 64 rows (models.md §4.5)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((576, 300)).astype(ml_dtypes.float8_e4m3fn)
    scale = (2.0 ** rng.integers(-8, 3, size=(5, 3))).astype(np.float32)
    got = dequantize_fp8_block(q, scale, (128, 128))
    rows, cols = np.meshgrid(np.arange(576), np.arange(300), indexing="ij")
    want = q.astype(np.float32) * scale[rows // 128, cols // 128]
    np.testing.assert_array_equal(got, want)


def test_fp8_scale_shape_checked():
    q = np.zeros((576, 256), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"\(5, 2\)"):
        dequantize_fp8_block(q, np.ones((4, 2), np.float32), (128, 128))


def _pack_along(values: np.ndarray, axis: int) -> np.ndarray:
    """Spec encoder (models.md §4.7): signed 4-bit values +8, eight per int32, element k at bits 4k."""
    v = np.moveaxis(values + 8, axis, -1).astype(np.uint32)
    pad = (-v.shape[-1]) % 8
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.uint32)], axis=-1)
    v = v.reshape(v.shape[:-1] + (-1, 8))
    words = np.zeros(v.shape[:-1], np.uint32)
    for k in range(8):
        words |= v[..., k] << np.uint32(4 * k)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_pack_quantized_roundtrip(symmetric):
    rng = np.random.default_rng(1)
    out, inp, group = 20, 70, 32  # neither dim a multiple of 8 or of the group
    groups = -(-inp // group)
    q = rng.integers(-8, 8, size=(out, inp))
    zp = np.zeros((out, groups), np.int64) if symmetric else rng.integers(-8, 8, size=(out, groups))
    scale = rng.uniform(0.01, 0.1, size=(out, groups)).astype(ml_dtypes.bfloat16)
    want = (q - np.repeat(zp, group, 1)[:, :inp]) * np.repeat(scale.astype(np.float32), group, 1)[:, :inp]
    got = dequantize_int4_packed(
        _pack_along(q, 1), scale, None if symmetric else _pack_along(zp, 0), (out, inp), group
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=0)
