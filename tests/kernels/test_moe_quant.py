"""MoE expert kernels with INT4 / FP8 / FP4 experts vs the reference (CPU, interpret mode).

Fresh random codes, scales and zero points per case; routings from one token to 2048, 8 to 256
experts, skewed (uneven groups, empty experts, experts over several blocks) and with dropped ids.
The reference dequantizes the experts by their formats' definitions (already held to
``jaxdsa.checkpoints.quant`` in test_quant_matmul.py) and runs the grouped GEMMs in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels._triton import compute_capability, lower_for_cuda
from pallas_kernels.moe import kernel, ref
from pallas_kernels.moe.tuning import MoeConfig, Tile
from pallas_kernels.quant import layout

_ref = jax.jit(ref.moe_experts, static_argnames=("swiglu_limit",))


@functools.partial(jax.jit, static_argnames=("swiglu_limit", "config", "decode"))
def _kernel(x, ids, weights, experts, *, swiglu_limit, config=None, decode=None):
    return kernel.moe_experts(
        x, ids, weights, experts, swiglu_limit=swiglu_limit, interpret=True, config=config, decode=decode
    )


def _routing(rng, t, k, e, *, skew, invalid=0.1):
    scores = rng.gumbel(size=(t, e)) + skew * np.linspace(6.0, 0.0, e)
    ids = np.argsort(-scores, axis=1)[:, :k]
    bad = rng.random((t, k)) < invalid
    ids[bad] = rng.choice([-1, e, e + 3], size=int(bad.sum()))
    return jnp.asarray(ids, jnp.int32)


def _matrices(rng, fmt: str, e: int, n: int, k: int, group: int, symmetric: bool, kpack: int | None = None):
    """One quantized [E, K, N] stack from random checkpoint-form codes (HF [E, N, K]); ``kpack``: FP4's
    packed chunk (None: the layout's default)."""
    if fmt == "int4":
        q = rng.integers(-8, 8, size=(e, n, k))
        zp = None if symmetric else rng.integers(-8, 8, size=(e, n, k // group))
        s = (rng.uniform(0.5, 1.5, size=(e, n, k // group)) / (8 * np.sqrt(k))).astype(ml_dtypes.bfloat16)
        return layout.pack_int4(q, s, zp, group_size=group)
    if fmt == "fp8":
        codes = rng.integers(0, 256, size=(e, n, k)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        scale = (rng.uniform(0.5, 2, size=(e, -(-n // 128), -(-k // 128))) / (64 * np.sqrt(k))).astype(
            np.float32
        )
        return layout.pack_fp8(codes.view(ml_dtypes.float8_e4m3fn), scale, block=(128, 128))
    codes = rng.integers(0, 16, size=(e, n, k)).astype(np.uint8)
    scale = rng.integers(119, 124, size=(e, n, k // 32)).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return layout.pack_fp4(codes, scale, kpack=kpack)


def _experts(rng, fmt, e, d, n, *, group=32, symmetric=False, kpack=None):
    gate, up = (_matrices(rng, fmt, e, n, d, group, symmetric, kpack) for _ in range(2))
    down = _matrices(rng, fmt, e, d, n, group, symmetric, kpack)
    return jax.tree.map(jnp.asarray, ref.pack_experts(gate, up, down))


def _check(x, ids, weights, experts, *, swiglu_limit=None, config=None, decode=None):
    got = _kernel(x, ids, weights, experts, swiglu_limit=swiglu_limit, config=config, decode=decode)
    want = _ref(x, ids, weights, experts, swiglu_limit=swiglu_limit)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert rel <= (2e-2 if x.dtype == jnp.bfloat16 else 1e-5), rel
    dropped = np.asarray(((ids < 0) | (ids >= experts["down"].shape[0])).all(axis=1))
    assert (got[dropped] == 0).all()


CASES = [  # (format, T, k, E, D, N, dtype, decode, group, symmetric, skew)
    pytest.param("int4", 1, 8, 256, 64, 32, jnp.bfloat16, None, 32, False, 0.0, id="int4-g32-T1-E256"),
    pytest.param("int4", 40, 2, 8, 128, 128, jnp.float32, None, 128, True, 2.0, id="int4-g128-sym-T40-E8"),
    pytest.param("int4", 256, 2, 64, 64, 32, jnp.bfloat16, None, 32, False, 3.0, id="int4-T256-E64-skewed"),
    pytest.param("fp8", 37, 8, 256, 64, 32, jnp.float32, "software", 0, False, 2.0, id="fp8-T37-E256-sw"),
    pytest.param("fp8", 96, 1, 8, 64, 32, jnp.bfloat16, "native", 0, False, 3.0, id="fp8-T96-E8-native"),
    pytest.param("fp4", 64, 4, 16, 64, 64, jnp.float32, None, 0, False, 1.0, id="fp4-T64-E16"),
    # K = 256 on both matrices: INT4 codes in int32 words (layout.WORD_KPACK)
    pytest.param("int4", 37, 4, 16, 256, 256, jnp.bfloat16, None, 32, False, 1.5, id="int4-words-T37-E16"),
    pytest.param("int4", 3, 2, 8, 512, 256, jnp.float32, None, 128, True, 0.0, id="int4-words-g128-sym-f32"),
]


@pytest.mark.parametrize("fmt,t,k,e,d,n,dtype,mode,group,symmetric,skew", CASES)
def test_matches_reference(fmt, t, k, e, d, n, dtype, mode, group, symmetric, skew):
    rng = np.random.default_rng(t * 7 + e)
    experts = _experts(rng, fmt, e, d, n, group=group or 32, symmetric=symmetric)
    x = jnp.asarray(rng.standard_normal((t, d)), dtype)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    _check(
        x,
        _routing(rng, t, k, e, skew=skew),
        weights,
        experts,
        swiglu_limit=0.3 if fmt == "fp4" else None,
        decode=mode,
    )


def test_fp4_words_give_the_bytes_results():
    """FP4 experts in int32 words (eight 32-row nibbles a word, as INT4's routed experts) compute what
    the same codes in bytes compute, bit for bit, and the reference's result."""
    make = lambda kpack: _experts(np.random.default_rng(5), "fp4", 8, 256, 256, kpack=kpack)  # noqa: E731
    words, bytes_ = make(layout.WORD_KPACK), make(64)
    assert words["down"].codes.dtype == jnp.int32 and bytes_["down"].codes.dtype == jnp.uint8
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((9, 256)), jnp.bfloat16)
    ids, weights = _routing(rng, 9, 2, 8, skew=1.0), jnp.asarray(rng.random((9, 2)), jnp.float32)
    got = _kernel(x, ids, weights, words, swiglu_limit=None)
    np.testing.assert_array_equal(got, _kernel(x, ids, weights, bytes_, swiglu_limit=None))
    _check(x, ids, weights, words)


@pytest.mark.parametrize("t", [1, 8, 300])
@pytest.mark.parametrize("kpack", [64, layout.WORD_KPACK])
def test_fp4_ptx_decode_on_gpu(t, kpack):
    """On a GPU, compiled: the packed-register FP4 decode ('ptx') gives the float32 decode's bits in
    both kernels, bytes and words, and the reference's result."""
    if compute_capability() < 80:  # asked at run time: JAX must not start at collection
        pytest.skip("inline PTX runs only on a GPU")
    rng = np.random.default_rng(t + kpack)
    experts = _experts(rng, "fp4", 16, 256, 256, kpack=kpack)
    x = jnp.asarray(rng.standard_normal((t, 256)), jnp.bfloat16)
    ids, weights = _routing(rng, t, 4, 16, skew=1.0), jnp.asarray(rng.random((t, 4)), jnp.float32)
    run = jax.jit(kernel.moe_experts, static_argnames="int4_decode")
    got = run(x, ids, weights, experts, int4_decode="ptx")
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(run(x, ids, weights, experts, int4_decode="f32"))
    )
    want = np.asarray(_ref(x, ids, weights, experts, swiglu_limit=None), np.float32)
    assert np.linalg.norm(np.asarray(got, np.float32) - want) <= 2e-2 * np.linalg.norm(want)


@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp4"])
def test_layer_stack_read_in_place(fmt):
    """Quantized experts stacked over 3 layers (codes, scales and zero points ``[L, E, ...]``) with a
    traced layer index: exactly the result on that layer's own experts, for every layer."""
    rng = np.random.default_rng(21)
    per_layer = [_experts(rng, fmt, 8, 64, 32) for _ in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    assert stack["gate_up"].shape == (3, 8, 64, 64) and stack["down"].shape == (3, 8, 32, 64)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    ids, weights = _routing(rng, 5, 2, 8, skew=1.0), jnp.asarray(rng.random((5, 2)), jnp.float32)
    run = jax.jit(lambda layer: kernel.moe_experts(x, ids, weights, stack, layer=layer, interpret=True))
    run_ref = jax.jit(lambda layer: ref.moe_experts(x, ids, weights, stack, layer=layer))
    for i, experts in enumerate(per_layer):
        np.testing.assert_array_equal(run(jnp.int32(i)), _kernel(x, ids, weights, experts, swiglu_limit=None))
        np.testing.assert_array_equal(run_ref(jnp.int32(i)), _ref(x, ids, weights, experts))


def test_experts_over_several_blocks():
    """16-row blocks: experts spanning up to four blocks, an empty expert, with INT4 weights (the row
    tiling is the dense kernels'; only the weight reads differ)."""
    rng = np.random.default_rng(9)
    counts = [16 + 5, 3, 0, 3 * 16 + 9, 16]
    ids = jnp.asarray(rng.permutation(np.repeat(np.arange(len(counts)), counts))[:, None], jnp.int32)
    experts = _experts(rng, "int4", len(counts), 64, 32)
    x = jnp.asarray(rng.standard_normal((ids.shape[0], 64)), jnp.float32)
    cfg = MoeConfig(16, Tile(32, 64, 4, 2), Tile(32, 32, 4, 2), absorb_m=0)
    _check(x, ids, jnp.ones(ids.shape, jnp.float32), experts, config=cfg)


@pytest.mark.parametrize(
    "fmt,t,dtype,splits",
    [
        ("int4", 2, jnp.float32, 2),
        ("int4", 1, jnp.bfloat16, 2),
        ("fp8", 3, jnp.bfloat16, 4),
        ("fp4", 2, jnp.float32, 4),
        ("fp4", 5, jnp.bfloat16, 2),
    ],
)
def test_k_splits(fmt, t, dtype, splits):
    """Quantized experts with gate|up split over K at decode sizes (float32 partial sums added by
    their own kernel; INT4 in int32 words: K = 512 in 256-row chunks), with the clamp and dropped
    ids."""
    rng = np.random.default_rng(31 + t)
    experts = _experts(rng, fmt, 8, 512, 64)
    x = jnp.asarray(rng.standard_normal((t, 512)), dtype)
    ids, weights = _routing(rng, t, 4, 8, skew=0.0, invalid=0.2), jnp.asarray(rng.random((t, 4)), jnp.float32)
    block_k = 256 if fmt == "int4" else 64
    cfg = MoeConfig(16, Tile(32, block_k, 4, 2), Tile(32, block_k // 4, 4, 2), splits=splits)
    _check(x, ids, weights, experts, swiglu_limit=0.3, config=cfg)


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_120"])
@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp4"])
def test_k_split_lowers(target, fmt):
    """A K-split gate|up with quantized weights (INT4 in words on both matrices) through the Triton
    lowering: three kernels (gate|up, the splits' sum, down) and one XLA reduction (the combine's
    over a token's slots)."""
    experts = jax.eval_shape(lambda: _experts(np.random.default_rng(0), fmt, 8, 512, 256))
    block_k = 256 if fmt == "int4" else 64
    cfg = MoeConfig(16, Tile(64, block_k, 4, 2), Tile(64, block_k, 4, 2), splits=2)
    text = lower_for_cuda(
        kernel.moe_experts,
        jax.ShapeDtypeStruct((1, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, 4), jnp.int32),
        jax.ShapeDtypeStruct((1, 4), jnp.float32),
        experts,
        target=target,
        config=cfg,
        swiglu_limit=7.0,
        decode="software" if fmt == "fp8" else None,
    )
    assert text.count("__gpu$xla.gpu.triton") == 3 and text.count("stablehlo.reduce") == 1


@pytest.mark.parametrize("t", [1, 8, 300])
@pytest.mark.parametrize("group,symmetric", [(32, False), (128, True)])
def test_int4_ptx_decode_on_gpu(t, group, symmetric):
    """On a GPU, compiled: the packed-register INT4 decode ('ptx') gives the bf16-arithmetic decode's
    bits in both kernels (one block per slot at T = 1, grouped blocks above), and the reference."""
    if compute_capability() < 80:  # asked at run time: JAX must not start at collection
        pytest.skip("inline PTX runs only on a GPU")
    rng = np.random.default_rng(t + group)
    experts = _experts(rng, "int4", 16, 256, 128, group=group, symmetric=symmetric)
    x = jnp.asarray(rng.standard_normal((t, 256)), jnp.bfloat16)
    ids, weights = _routing(rng, t, 4, 16, skew=1.0), jnp.asarray(rng.random((t, 4)), jnp.float32)
    run = jax.jit(kernel.moe_experts, static_argnames="int4_decode")
    got = run(x, ids, weights, experts, int4_decode="ptx")
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(run(x, ids, weights, experts, int4_decode="bf16"))
    )
    want = np.asarray(_ref(x, ids, weights, experts, swiglu_limit=None), np.float32)
    assert np.linalg.norm(np.asarray(got, np.float32) - want) <= 2e-2 * np.linalg.norm(want)
