"""NVFP4 weights (docs/models.md §4.8) in the kernels' layout and in both kernels (CPU, interpret mode).

The layout's packer and dequantizer are held bit for bit to the NumPy decoder of
``jaxdsa.checkpoints.quant`` (written from the bit layouts, itself held to ml_dtypes); ``quant_matmul``
and ``moe_experts`` to their references on fresh random codes (all 16 e2m1 codes), e4m3 scales and
global scales that differ from matrix to matrix (gate and up of one expert included), ragged widths
(N = 136, K = 96: global-scale groups narrower than the tiles), empty experts, K splits, the GEMV
kernel and layer stacks; both e4m3 decodes (the integer one sm_80 takes, and the native cast).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdsa.checkpoints import quant as formats
from pallas_kernels._triton import compute_capability
from pallas_kernels.moe import kernel as moe_kernel
from pallas_kernels.moe import ref as moe_ref
from pallas_kernels.moe.tuning import MoeConfig, Tile
from pallas_kernels.quant import decode, layout
from pallas_kernels.quant_matmul import kernel, ref, tuning
from tests.kernels.test_quant_matmul import _device, _rel, _same_bits, _same_leaves


def random_nvfp4(rng, lead, n, k, *, nan=False):
    """(weight in the kernels' layout, float32 ``[..., K, N]`` values by the NumPy decoder) from random
    checkpoint tensors: every e2m1 code, e4m3 scales over ~2^-3 .. 2^3 (the NaN bytes only if
    ``nan``), and one global scale per matrix, not a power of two."""
    codes = rng.integers(0, 16, size=(*lead, n, k)).astype(np.uint8)
    codes.reshape(-1, k)[0, :16] = np.arange(16)
    scale = rng.integers(0x20, 0x50, size=(*lead, n, k // 16)).astype(np.uint8)
    if nan:
        scale.reshape(-1)[[1, 5]] = (0x7F, 0xFF)
    scale = scale.view(ml_dtypes.float8_e4m3fn)
    g = (rng.uniform(0.5, 2.0, size=lead) / (4 * np.sqrt(k))).astype(np.float32)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the checkpoint's bytes
    want = formats.dequantize_nvfp4(packed, scale, g)
    return layout.pack_nvfp4(formats.unpack_fp4(packed), scale, g), np.swapaxes(want, -1, -2)


# ---- layout ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lead,n,k", [((), 136, 96), ((3,), 64, 128), ((), 48, 512)])
def test_dequantize_is_the_format_definition(lead, n, k):
    """NumPy- and jnp-packed leaves agree; dequantize() is the NumPy decoder bit for bit (NaN scale
    codes included); the global scales cover the largest power-of-two blocks, one value per matrix."""
    rng = np.random.default_rng(n + k)
    w, want = random_nvfp4(rng, lead, n, k, nan=True)
    assert w.shape == want.shape and w.global_group == (k & -k, n & -n)
    assert w.global_scales.dtype == np.float32 and w.global_scales.shape == (
        *lead,
        k // (k & -k),
        n // (n & -n),
    )
    codes = layout.unpack_nibbles(w.codes, w.kpack)
    scale = np.swapaxes(w.scales, -1, -2)
    g = w.global_scales[..., 0, 0]
    jw = layout.pack_nvfp4(*map(jnp.asarray, (np.swapaxes(codes, -1, -2), scale, g)))
    _same_leaves(w, jw)
    _same_bits(layout.dequantize(_device(w)), want)
    assert np.isnan(want).any()


def test_gate_up_join_keeps_each_global_scale():
    """gate | up with different global scales (vLLM would take the gate's for both): every column
    keeps its own matrix's; narrower groups after a reblock give the same values."""
    rng = np.random.default_rng(1)
    (gate, g_want), (up, u_want) = (random_nvfp4(rng, (2,), 48, 64) for _ in range(2))
    both = layout.concat_n(gate, up)
    assert both.global_group == (64, 16) and both.global_scales.shape == (2, 1, 6)
    assert not np.array_equal(gate.global_scales[..., 0, 0], up.global_scales[..., 0, 0])
    joined = np.concatenate([g_want, u_want], axis=-1)
    _same_bits(layout.dequantize(_device(both)), joined)
    narrow = layout.reblock_global(both, (32, 8))
    assert narrow.global_scales.shape == (2, 2, 12)
    _same_bits(layout.dequantize(_device(narrow)), joined)
    with pytest.raises(ValueError, match="cannot reblock"):
        layout.reblock_global(narrow, (64, 8))


def test_padding_and_split_checks():
    """Zero weights appended along N and K (whole chunks); splits must keep whole global groups."""
    rng = np.random.default_rng(2)
    w, want = random_nvfp4(rng, (), 24, 64)
    padded = layout.pad_k(layout.pad_n(w, 40), 128)
    assert padded.shape == (128, 40) and padded.global_scales.shape == (2, 5)
    _same_bits(layout.dequantize(_device(padded)), np.pad(want, ((0, 64), (0, 16))))
    w, _ = random_nvfp4(rng, (), 96, 256)  # global groups (256, 32)
    layout.check_split(w, "n", 3)
    with pytest.raises(ValueError, match="whole 32-element"):
        layout.check_split(w, "n", 6)
    with pytest.raises(ValueError, match="whole 256-element"):
        layout.check_split(w, "k", 2)
    layout.check_split(layout.reblock_global(w, (128, 32)), "k", 2)


# ---- quant_matmul ----------------------------------------------------------------------------------

_ref = jax.jit(ref.quant_matmul)


@pytest.mark.parametrize("mode", decode.MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_dequantizes_bit_for_bit(mode, dtype):
    """x = I makes the output the dequantized weight: the format's values exactly (bf16: those values
    rounded once), through both e4m3 decodes, with 136 columns (global groups of 8 under 16-column
    tiles: padded in the op) and K = 96 (32-row chunks). (A NaN scale would spread over its column
    through the zeros of the identity; the decoders' NaN codes are tested element by element.)"""
    rng = np.random.default_rng(7)
    w, want = random_nvfp4(rng, (), 136, 96)
    got = kernel.quant_matmul(jnp.eye(96, dtype=dtype), _device(w), interpret=True, decode=mode)
    assert got.dtype == dtype
    _same_bits(got, want.astype(np.dtype(dtype)).astype(np.float32) + np.float32(0))


def _gemv(m: int, splits: int) -> tuning.QmmConfig:
    return tuning.QmmConfig(m, 64, 64, splits, 4, 2, gemv=True)


CASES = [  # (N, K, M, dtype, decode mode, config)
    pytest.param(64, 128, 1, jnp.bfloat16, None, None, id="M1-bf16"),
    pytest.param(136, 96, 37, jnp.float32, "software", None, id="N136-K96-M37-f32-sw"),
    pytest.param(48, 512, 9, jnp.float32, "native", tuning.QmmConfig(16, 16, 128, 2, 4, 2), id="K512-splits"),
    pytest.param(96, 256, 300, jnp.bfloat16, "software", None, id="M300-bf16"),
    pytest.param(64, 256, 3, jnp.float32, None, _gemv(3, 2), id="gemv-M3-split2"),
    pytest.param(80, 128, 1, jnp.bfloat16, "native", _gemv(1, 1), id="gemv-N80-M1-bf16"),
]


@pytest.mark.parametrize("n,k,m,dtype,mode,config", CASES)
def test_matches_reference(n, k, m, dtype, mode, config):
    rng = np.random.default_rng(m + n)
    w, _ = random_nvfp4(rng, (), n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    got = kernel.quant_matmul(x, _device(w), interpret=True, decode=mode, config=config)
    want = _ref(x, _device(w))
    assert got.shape == want.shape and got.dtype == dtype
    assert _rel(got, want) <= (1e-5 if dtype == jnp.float32 else 8e-3), _rel(got, want)


def test_layer_stack_and_many_weights():
    """Layers stacked ``[L, K, N]`` (each its own global scale) read at a traced index, and two
    weights of different global scales in one launch: each exactly its own product."""
    rng = np.random.default_rng(11)
    per_layer = [_device(random_nvfp4(rng, (), 64, 128)[0]) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    run = jax.jit(lambda layer: kernel.quant_matmul(x, stack, layer=layer, interpret=True))
    for i, w in enumerate(per_layer):
        np.testing.assert_array_equal(run(jnp.int32(i)), kernel.quant_matmul(x, w, interpret=True))
        np.testing.assert_array_equal(ref.quant_matmul(x, stack, layer=jnp.int32(i)), _ref(x, w))
    a, b = per_layer[0], _device(random_nvfp4(rng, (), 32, 128)[0])
    got = kernel.quant_matmul_many(x, (a, b), interpret=True)
    for out, w in zip(got, (a, b)):
        assert _rel(out, _ref(x, w)) <= 1e-5


# ---- moe_experts -----------------------------------------------------------------------------------


def _experts(rng, e, d, n):
    """gate, up and down stacks, every matrix (each expert's gate and up too) its own global scale."""
    gate, up = (random_nvfp4(rng, (e,), n, d)[0] for _ in range(2))
    down = random_nvfp4(rng, (e,), d, n)[0]
    return jax.tree.map(jnp.asarray, moe_ref.pack_experts(gate, up, down))


def _routing(rng, t, k, e, *, skew):
    scores = rng.gumbel(size=(t, e)) + skew * np.linspace(6.0, 0.0, e)
    ids = np.argsort(-scores, axis=1)[:, :k]
    ids[rng.random((t, k)) < 0.1] = -1  # dropped slots
    return jnp.asarray(ids, jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "decode"))
def _moe(x, ids, weights, experts, *, config=None, decode=None):
    return moe_kernel.moe_experts(
        x, ids, weights, experts, swiglu_limit=0.5, interpret=True, config=config, decode=decode
    )


MOE_CASES = [  # (T, k, E, D, N, dtype, decode, skew, config)
    pytest.param(1, 8, 256, 64, 32, jnp.bfloat16, None, 0.0, None, id="T1-E256-bf16"),
    pytest.param(64, 4, 16, 96, 64, jnp.float32, "software", 3.0, None, id="T64-E16-D96-skewed-sw"),
    pytest.param(37, 2, 8, 128, 128, jnp.float32, "native", 1.0, None, id="T37-E8-native"),
    pytest.param(
        3,
        4,
        8,
        512,
        64,
        jnp.bfloat16,
        None,
        0.0,
        MoeConfig(16, Tile(32, 64, 4, 2), Tile(32, 64, 4, 2), splits=4),
        id="T3-K-splits",
    ),  # fmt: skip
]


@pytest.mark.parametrize("t,k,e,d,n,dtype,mode,skew,config", MOE_CASES)
def test_moe_matches_reference(t, k, e, d, n, dtype, mode, skew, config):
    """Skewed routings leave experts empty; the reference dequantizes by the format's definition."""
    rng = np.random.default_rng(t * 7 + e)
    experts = _experts(rng, e, d, n)
    x = jnp.asarray(rng.standard_normal((t, d)), dtype)
    ids, weights = _routing(rng, t, k, e, skew=skew), jnp.asarray(rng.random((t, k)), jnp.float32)
    got = np.asarray(_moe(x, ids, weights, experts, config=config, decode=mode), np.float32)
    want = np.asarray(moe_ref.moe_experts(x, ids, weights, experts, swiglu_limit=0.5), np.float32)
    assert np.isfinite(got).all()
    assert _rel(got, want) <= (2e-2 if dtype == jnp.bfloat16 else 1e-5), _rel(got, want)
    empty = np.setdiff1d(np.arange(e), np.asarray(ids))
    assert skew == 0.0 or empty.size  # the skewed routings leave some experts without a token


def test_moe_layer_stack_read_in_place():
    rng = np.random.default_rng(21)
    per_layer = [_experts(rng, 8, 64, 32) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    ids, weights = _routing(rng, 5, 2, 8, skew=1.0), jnp.asarray(rng.random((5, 2)), jnp.float32)
    run = jax.jit(lambda layer: moe_kernel.moe_experts(x, ids, weights, stack, layer=layer, interpret=True))
    for i, experts in enumerate(per_layer):
        want = moe_kernel.moe_experts(x, ids, weights, experts, interpret=True)
        np.testing.assert_array_equal(run(jnp.int32(i)), want)


# ---- on a GPU: the e2m1 values from inline PTX --------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ptx_values_bit_for_bit_on_gpu(dtype):
    """On a GPU, compiled: with 'ptx' the e2m1 values come from packed registers (exact, then the
    float32 product as the format defines it); the identity gives the format's values bit for bit,
    as the integer decode does, and the MoE kernels give the integer decode's bits."""
    if compute_capability() < 80:  # asked at run time: JAX must not start at collection
        pytest.skip("inline PTX runs only on a GPU")
    rng = np.random.default_rng(12)
    w, want = random_nvfp4(rng, (), 136, 256)
    run = jax.jit(kernel.quant_matmul, static_argnames="int4_decode")
    got = run(jnp.eye(256, dtype=dtype), _device(w), int4_decode="ptx")
    _same_bits(got, want.astype(np.dtype(dtype)).astype(np.float32) + np.float32(0))
    experts = _experts(rng, 16, 256, 128)
    x = jnp.asarray(rng.standard_normal((9, 256)), dtype)
    ids, weights = _routing(rng, 9, 4, 16, skew=1.0), jnp.asarray(rng.random((9, 4)), jnp.float32)
    moe = jax.jit(moe_kernel.moe_experts, static_argnames="int4_decode")
    np.testing.assert_array_equal(
        np.asarray(moe(x, ids, weights, experts, int4_decode="ptx")),
        np.asarray(moe(x, ids, weights, experts, int4_decode="f32")),
    )
