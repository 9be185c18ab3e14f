"""Sparse-MLA Pallas kernel vs the float32 reference (CPU, interpret mode) + CUDA lowering.

Interpret mode runs the real kernel body on the CPU one grid step at a time, so shapes stay
small; the production shapes are only lowered (Pallas -> Triton IR), which is cheap and catches
what the interpreter forgives (non-power-of-two tiles, unsupported primitives). On a GPU,
``JAX_PLATFORMS=cuda JAXDSA_KERNELS=pallas`` runs the same comparisons on the compiled kernels
instead (tests/conftest.py otherwise pins JAX to the CPU).

The fp8 tests (``-k fp8``) read FP8 latent rows (:mod:`pallas_kernels.quant.kv_fp8`: e4m3 values,
scales, bf16 rope, three arrays) with both e4m3 decoders, in GLM's ``DS_MLA`` form (float32 scales
per 128, V = the e4m3 part), DeepSeek-V4's ``MODEL1`` (ue8m0 scale bytes per 64, or one for the tiny
models' 24 values; V = the whole row, rope included) and mixes of the two: the writer's rows,
hand-made ones with extreme and non-power-of-two scales, and every e4m3 code decoded bit-exactly
through the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels._triton import lower_for_cuda, shared_memory_budget, sm_count
from pallas_kernels.quant import kv_fp8
from pallas_kernels.sparse_mla import kernel, ref, tuning
from pallas_kernels.sparse_mla.tuning import MlaConfig

_INTERPRET = os.environ.get("JAXDSA_KERNELS", "").strip().lower() != "pallas"


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_dim", "config", "fp8_decode"))
def _kernel(q, kv, indices, sink, kv_scale=None, kv_rope=None, *, sm_scale, v_dim, config, fp8_decode=None):
    return kernel.sparse_mla(
        q,
        kv,
        indices,
        sm_scale=sm_scale,
        sink=sink,
        v_dim=v_dim,
        kv_scale=kv_scale,
        kv_rope=kv_rope,
        interpret=_INTERPRET,
        config=config,
        fp8_decode=fp8_decode,
    )


_reference = jax.jit(ref.sparse_mla, static_argnames=("sm_scale", "v_dim"))


def _inputs(seed, t, h, n, k, d, dtype, sink):
    """Random q/kv (never all zeros), indices with -1s, out-of-range slots, duplicates, ragged tails."""
    kq, kkv, ki, kl, ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(kq, (t, h, d), jnp.float32).astype(dtype)
    kv = jax.random.normal(kkv, (n, d), jnp.float32).astype(dtype)
    idx = np.array(jax.random.randint(ki, (t, k), -1, n + 4))  # -1 and >= n are both invalid
    lengths = np.array(jax.random.randint(kl, (t,), 0, k + 1))
    lengths[0] = k
    for row, length in enumerate(lengths):  # ragged: each row ends in -1 padding
        idx[row, length:] = -1
    idx[0, : k // 2] = idx[0, k // 2 : 2 * (k // 2)]  # duplicates count as separate keys
    if t > 1:
        idx[-1, :] = -1  # a row with no valid key at all
    s = jax.random.normal(ks, (h,), jnp.float32) if sink else None
    return q, kv, jnp.asarray(idx, jnp.int32), s


def _check(q, kv, idx, s, *, v_dim, config=None, scale=0.1, fp8_decode=None):
    """``kv``: float rows, or the FP8 parts ``(values, scales, rope)`` (the reference decodes them)."""
    kv, *fp8 = kv if isinstance(kv, tuple) else (kv,)
    out, lse = _kernel(q, kv, idx, s, *fp8, sm_scale=scale, v_dim=v_dim, config=config, fp8_decode=fp8_decode)
    parts = dict(zip(("kv_scale", "kv_rope"), fp8, strict=False))
    ref_kv = kv if fp8 else kv.astype(jnp.float32)
    want_out, want_lse = _reference(
        q.astype(jnp.float32), ref_kv, idx, sm_scale=scale, sink=s, v_dim=v_dim, **parts
    )
    assert out.shape == want_out.shape and out.dtype == q.dtype and lse.dtype == jnp.float32
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    want_out, want_lse = np.asarray(want_out), np.asarray(want_lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    bf16 = q.dtype == jnp.bfloat16
    rel = np.linalg.norm(out - want_out) / max(np.linalg.norm(want_out), 1e-30)
    assert rel <= (1e-2 if bf16 else 1e-5), rel
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=2e-2 if bf16 else 1e-5)
    empty = (idx < 0) | (idx >= kv.shape[0])
    empty_rows = np.asarray(empty.all(axis=1))
    assert (out[empty_rows] == 0).all()
    if s is not None:
        np.testing.assert_array_equal(lse[empty_rows], np.broadcast_to(np.asarray(s), lse[empty_rows].shape))


# (T, H, N, K, D, v_dim, dtype, sink, config); config None = the tuning rule (CPU -> default table).
CASES = {
    # B = 1 decode: the rule splits K (merge path), K = 100 is not a multiple of any block.
    "decode_h16_bf16_sink": (1, 16, 512, 100, 576, 512, jnp.bfloat16, True, None),
    # two head groups x three splits (the last one partial); ragged rows, an all-invalid row -> -inf.
    "h64_f32_split": (3, 64, 300, 40, 576, 512, jnp.float32, False, MlaConfig(32, 16, 4, 2, 3)),
    # H = 128 as two 64-head groups in one pass; the sink is folded in-kernel (no split).
    "h128_bf16_sink": (2, 128, 256, 72, 576, 512, jnp.bfloat16, True, MlaConfig(64, 32, 8, 2, 1)),
    "h128_bf16_split": (2, 128, 256, 72, 576, 512, jnp.bfloat16, False, MlaConfig(128, 16, 8, 2, 4)),
    # the next step's indices carried through the loop: ragged last step, splits, a sink.
    "prefetch_split_sink": (
        3,
        16,
        300,
        100,
        576,
        512,
        jnp.float32,
        True,
        MlaConfig(16, 16, 4, 2, 3, prefetch=True),
    ),
    # bf16 partial outputs between the split kernel and the merge.
    "narrow_partials_split_sink": (
        2,
        16,
        300,
        100,
        576,
        512,
        jnp.bfloat16,
        True,
        MlaConfig(16, 16, 4, 2, 3, narrow_partials=True),
    ),
    # the tiny test models: 4 heads (padded to 16), 136 = 128 + 8 columns (padded to 128 + 16).
    "tiny_model_f32_sink": (5, 4, 64, 8, 136, 128, jnp.float32, True, None),
    # the whole row is the value (DeepSeek-V4 style): no rope part.
    "value_only_row": (2, 16, 96, 24, 64, 64, jnp.bfloat16, False, None),
    # prefill-sized T with tiny dims so the interpreter stays fast.
    "many_queries": (2048, 16, 64, 24, 32, 16, jnp.bfloat16, True, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    t, h, n, k, d, v_dim, dtype, sink, config = CASES[name]
    q, kv, idx, s = _inputs(len(name), t, h, n, k, d, dtype, sink)
    _check(q, kv, idx, s, v_dim=v_dim, config=config)


def test_all_invalid_and_extreme_sinks():
    """Sinks of -inf (no-op) and +inf (out 0, lse +inf) on a full row and on a row with no valid key."""
    q, kv, idx, _ = _inputs(7, 2, 16, 64, 32, 576, jnp.float32, False)
    idx = idx.at[0].set(jnp.arange(32)).at[1, 3].set(64)  # row 1: nothing valid (64 == N is out of range)
    sink = jnp.linspace(-2.0, 2.0, 16).at[0].set(-jnp.inf).at[1].set(jnp.inf)
    _check(q, kv, idx, sink, v_dim=512, config=MlaConfig(16, 16, 4, 2, 1))


def test_tuning_rule_shapes(monkeypatch):
    """The rule fills at most one wave when it splits, caps the partial bytes, keeps MMA-legal tiles
    (measured TUNED exceptions aside)."""
    monkeypatch.setattr(tuning, "TUNED", {})
    for cc in (0, 80, 90, 120):
        monkeypatch.setattr(tuning, "compute_capability", lambda cc=cc: cc)
        num_sms = sm_count(cc)
        for t, h in [(1, 16), (1, 128), (8, 64), (32, 128), (128, 16), (4096, 128)]:
            cfg = tuning.choose(t, h, 2048, d_v=512, d_r=64, itemsize=2)
            assert cfg.block_h >= 16 and cfg.block_h & (cfg.block_h - 1) == 0
            if cfg.splits > 1:
                assert t * -(-h // cfg.block_h) * cfg.splits <= num_sms
                assert cfg.splits * t * h * 2048 <= max(t * 2048 * 1152, tuning.PARTIAL_FLOOR_BYTES)
            if t >= 128:
                assert cfg.splits == 1


def test_sm90_rule_matches_h100_sweep(monkeypatch):
    """The rule alone reproduces the sweep's printed 64-row winners (bf16, K = 2048;
    kernels_mla-sweep-h100*.md), and the 16-head decode keeps 32-row steps."""
    monkeypatch.setattr(tuning, "compute_capability", lambda: 90)
    choose = functools.partial(tuning.choose, k=2048, d_v=512, d_r=64, itemsize=2)
    assert choose(1, 16) == MlaConfig(16, 32, 8, 2, 64)  # table 27.7 us, bn64 28.7 us
    assert choose(32, 128) == MlaConfig(64, 64, 8, 2, 2)  # bn64 116.9 us, bn32 153.6 us (second sweep)
    assert choose(1, 64) == MlaConfig(16, 32, 8, 3, 32)  # TUNED: 3 stages, 13.4 vs 21.6 us
    assert choose(32, 16) == MlaConfig(16, 32, 8, 3, 4)  # TUNED: 3 stages, 61.3 vs 66.4 us (2026-11-23)
    tuned = dict(tuning.TUNED)
    monkeypatch.setattr(tuning, "TUNED", {})
    for (_, h, t), cfg in tuned.items():
        if cfg.block_n == 64:
            assert choose(t, h) == cfg, (h, t)


_TARGET_CC = {"sm_80": 80, "sm_90": 90, "sm_120": 120}

# (T, H, N, D, v_dim, sink): B = 1 splits K (sink applied by the merge); T = 64 / 4096 run one pass
# (sink in-kernel); H = 16 decode; the tiny models' padded 136 = 128 + 8 row with 4 heads.
_LOWERING_SHAPES = [
    (1, 128, 262144, 576, 512, True),
    (1, 16, 262144, 576, 512, False),
    (64, 128, 262144, 576, 512, True),
    (4096, 128, 262144, 576, 512, False),
    (8, 4, 1024, 136, 128, True),
]


@pytest.mark.parametrize("target", list(_TARGET_CC))
def test_lowers_for_cuda(target, monkeypatch):
    """Production shapes (and the padded tiny-model shape) lower to Triton IR for each GPU family."""
    from pallas_kernels.merge_states import tuning as merge_tuning

    monkeypatch.setattr(tuning, "compute_capability", lambda: _TARGET_CC[target])
    monkeypatch.setattr(merge_tuning, "compute_capability", lambda: _TARGET_CC[target])
    for t, h, n, d, v_dim, with_sink in _LOWERING_SHAPES:
        args = [
            jax.ShapeDtypeStruct((t, h, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((t, 2048), jnp.int32),
        ]
        if with_sink:
            args.append(jax.ShapeDtypeStruct((h,), jnp.float32))
        fn = functools.partial(_lower_target, sm_scale=0.1, v_dim=v_dim)
        assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, *args, target=target), (t, h, with_sink)


@pytest.mark.parametrize("h", [32, 64])
def test_lowers_float32_prefill_for_sm90(h, monkeypatch):
    """Float32 GLM-5 prefill at TP = 2 / 1 (32 / 64 heads, T = 256, K = 2048) with the configs the
    table shrinks to fit float32 operands."""
    monkeypatch.setattr(tuning, "compute_capability", lambda: 90)
    args = [
        jax.ShapeDtypeStruct((256, h, 576), jnp.float32),
        jax.ShapeDtypeStruct((4096, 576), jnp.float32),
        jax.ShapeDtypeStruct((256, 2048), jnp.int32),
    ]
    fn = functools.partial(_lower_target, sm_scale=0.1, v_dim=512)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, *args, target="sm_90")


def _lower_target(q, kv, indices, sink=None, *, sm_scale, v_dim, fp8_decode=None):
    return kernel.sparse_mla(q, kv, indices, sm_scale=sm_scale, sink=sink, v_dim=v_dim, fp8_decode=fp8_decode)


# ---- FP8 latent rows ---------------------------------------------------------------------------------

_NAN_CODES = (0x7F, 0xFF)
_FINITE_CODES = np.array([c for c in range(256) if c not in _NAN_CODES], np.uint8)
# Per-tile scales of the hand-made rows in the exact test: extreme powers of two, raw amax / 448
# (vLLM's writer), non-powers of two far from 1 (products stay float32 normals, so no flush-to-zero
# question). The reference comparisons take moderate ones: an output dominated by a 2^20 tile would
# hide errors in the others from a relative L2 norm.
_EXTREME_SCALES = np.array([2.0**-20, 2.0**20, 0.37 / 448, 3.3 / 448, 1e30, 3e-25, 2.0**-3], np.float32)
_MODERATE_SCALES = np.array([0.37 / 448, 1.3 / 448, 0.9 / 448, 2.0**-8, 2.0**-10], np.float32)
# ue8m0 bytes e (scale 2^(e - 127)): the extremes keep every product with an e4m3 value a float32
# normal (2^-9 * 2^(10 - 127) = 2^-126; 448 * 2^(246 - 127) < 2^128); the moderate ones are 2^-10 ..
# 2^-6, as the writer's scales of values up to ~30.
_EXTREME_E8M0 = np.array([10, 246, 127, 107, 147, 60, 200], np.uint8)
_MODERATE_E8M0 = np.array([117, 118, 119, 120, 121], np.uint8)

# Latent formats beyond the two released ones: GLM's rows with V4's scale bytes, V4's tiles with
# float32 scales.
_E8M0_128 = kv_fp8.LatentFormat("ue8m0 per 128", 128, jnp.uint8)
_F32_64 = kv_fp8.LatentFormat("float32 per 64", 64, jnp.float32)


def _hand_latent(seed: int, n: int, nope: int, rope_dim: int, codes=_FINITE_CODES, scales=None, tile=None):
    """FP8 latent parts ``(values e4m3 [n, nope], scales [n, nope / tile], rope bf16 [n, rope_dim])``
    (NumPy) of random ``codes`` (each of them at least once when there is room), per-tile ``scales``
    (float32 values or ue8m0 bytes; default GLM's moderate float32 ones, tile 128) drawn at random and
    random rope values."""
    scales = _MODERATE_SCALES if scales is None else scales
    rng = np.random.default_rng(seed)
    values = rng.choice(codes, (n, nope))
    if values.size >= len(codes):
        values.reshape(-1)[rng.permutation(values.size)[: len(codes)]] = rng.permutation(codes)
    tile_scales = rng.choice(scales, (n, nope // (tile or kv_fp8.TILE)))
    rope = rng.standard_normal((n, rope_dim)).astype(ml_dtypes.bfloat16)
    return values.view(ml_dtypes.float8_e4m3fn), tile_scales, rope


@functools.partial(jax.jit, static_argnums=(0, 2))
def _quantize(fmt: kv_fp8.LatentFormat, rows, nope: int):
    return fmt.quantize(rows, nope)


def _fp8_parts(parts) -> tuple:
    """``(values, scales, rope)`` as jax arrays; no rope array when the row is all value."""
    values, scales, rope = (jnp.asarray(p) for p in parts)
    return (values, scales, rope) if rope.shape[1] else (values, scales)


def _fp8_inputs(seed, t, h, n, k, nope, rope_dim, dtype, sink, fmt=kv_fp8.DS_MLA):
    """q, FP8 parts in ``fmt``, indices (with -1s, out-of-range slots, duplicates, ragged tails and an
    empty row, as :func:`_inputs` makes them) and sink, over a pool whose first half is the writer's
    parts of random rows (per-row magnitudes 1/2 or 1: power-of-two scales) and second half hand-made
    ones (non-power-of-two float32 scales or moderate ue8m0 bytes, every finite code). NumPy draws:
    eager jax.random costs seconds here."""
    rng = np.random.default_rng(seed)
    d = nope + rope_dim
    idx = rng.integers(-1, n + 4, (t, k))
    lengths = rng.integers(0, k + 1, t)
    lengths[0] = k
    for row, length in enumerate(lengths):
        idx[row, length:] = -1
    idx[0, : k // 2] = idx[0, k // 2 : 2 * (k // 2)]
    if t > 1:
        idx[-1] = -1
    half = n // 2
    rows = rng.standard_normal((half, d)).astype(np.float32) * rng.choice([0.5, 1.0], (half, 1))
    written = [np.asarray(p) for p in _quantize(fmt, rows, nope)]
    e8m0 = jnp.dtype(fmt.scale_dtype) == jnp.uint8
    scales = _MODERATE_E8M0 if e8m0 else _MODERATE_SCALES
    hand = _hand_latent(seed, n - half, nope, rope_dim, scales=scales, tile=fmt.tile_width(nope))
    parts = _fp8_parts(np.concatenate(pair) for pair in zip(written, hand, strict=True))
    q = jnp.asarray(rng.standard_normal((t, h, d)), dtype)
    s = jnp.asarray(rng.standard_normal(h), jnp.float32) if sink else None
    return q, parts, jnp.asarray(idx, jnp.int32), s


# (T, H, N, K, v_dim, rope, dtype, sink, decode, config); config None = the tuning rule. GLM's rows:
# DS_MLA parts, V = the v_dim e4m3 columns.
FP8_CASES = {
    # the tiny models' rows (rope 8 padded to 16), K = 40 not a multiple of block_n
    "tiny_f32_software_sink": (5, 4, 64, 40, 128, 8, jnp.float32, True, "software", None),
    "tiny_bf16_native": (5, 4, 64, 40, 128, 8, jnp.bfloat16, False, "native", None),
    # the released rows (512 + 64): three splits merged, sink in the merge
    "f32_software_split3_sink": (
        3, 16, 96, 100, 512, 64, jnp.float32, True, "software", MlaConfig(16, 16, 4, 2, 3)
    ),
    # 20 heads: two head groups, the second ragged; one split, sink in-kernel
    "f32_native_h20_sink": (2, 20, 96, 72, 512, 64, jnp.float32, True, "native", MlaConfig(16, 16, 4, 2, 1)),
    "bf16_software_prefetch_split2": (
        3, 16, 96, 100, 512, 64, jnp.bfloat16, False, "software", MlaConfig(16, 32, 4, 2, 2, prefetch=True)
    ),
    "bf16_native_narrow_partials_sink": (
        2, 16, 96, 100, 512, 64, jnp.bfloat16, True, "native",
        MlaConfig(16, 16, 4, 2, 4, narrow_partials=True),
    ),
    # no rope part: 128 values and one scale per row, no kv_rope
    "value_only_f32_software": (2, 16, 32, 24, 128, 0, jnp.float32, False, "software", None),
}  # fmt: skip
# Marked slow: the other three alone run both decoders, dtypes and row widths, splits, prefetch, sinks.
_SLOW_FP8 = {
    "tiny_bf16_native",
    "f32_software_split3_sink",
    "bf16_native_narrow_partials_sink",
    "value_only_f32_software",
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in _SLOW_FP8 else []) for n in FP8_CASES]
)
def test_fp8_matches_reference(name):
    t, h, n, k, v_dim, rope_dim, dtype, sink, decode, config = FP8_CASES[name]
    q, parts, idx, s = _fp8_inputs(len(name), t, h, n, k, v_dim, rope_dim, dtype, sink)
    _check(q, parts, idx, s, v_dim=v_dim, config=config, fp8_decode=decode)


# (T, H, N, K, C, rope, format, dtype, sink, decode, config): V = the whole C + rope row
# (DeepSeek-V4), except for the cases in _V_IS_NOPE (V = the e4m3 part, as GLM's).
V4_CASES = {
    # the released rows (448 + 64, ue8m0 per 64): three splits merged, sink in the merge
    "v4_bf16_native_split3_sink": (
        3, 16, 96, 100, 448, 64, kv_fp8.MODEL1, jnp.bfloat16, True, "native", MlaConfig(16, 16, 4, 2, 3)
    ),
    # prefetch (the raw parts and ue8m0 bytes carried a step ahead), two splits, float32 queries
    "v4_f32_software_prefetch_split2": (
        3, 16, 96, 100, 448, 64, kv_fp8.MODEL1, jnp.float32, False, "software",
        MlaConfig(16, 32, 4, 2, 2, prefetch=True),
    ),
    # 20 heads (two head groups, the second ragged), the tuning rule's config, sink
    "v4_f32_native_h20_rule_sink": (2, 20, 96, 72, 448, 64, kv_fp8.MODEL1, jnp.float32, True, "native", None),
    # the tiny models' rows: 24 values under one scale (a 24-wide tile padded to 32), rope 8 (to 16)
    "v4_tiny_f32_software_sink": (5, 4, 64, 40, 24, 8, kv_fp8.MODEL1, jnp.float32, True, "software", None),
    "v4_tiny_bf16_native_prefetch_split3": (
        5, 4, 64, 40, 24, 8, kv_fp8.MODEL1, jnp.bfloat16, False, "native",
        MlaConfig(16, 16, 4, 2, 3, prefetch=True),
    ),
    # mixed: float32 scales per 64 with V = the whole row; ue8m0 per 128 with V = the e4m3 part
    "mixed_f32_per64_row_bf16_software_sink": (
        3, 16, 64, 50, 256, 32, _F32_64, jnp.bfloat16, True, "software", MlaConfig(16, 16, 4, 2, 1)
    ),
    "mixed_e8m0_per128_nope_f32_native_split2": (
        3, 16, 64, 50, 256, 32, _E8M0_128, jnp.float32, False, "native", MlaConfig(16, 16, 4, 2, 2)
    ),
}  # fmt: skip
_V_IS_NOPE = {"mixed_e8m0_per128_nope_f32_native_split2"}
# Marked slow: the others alone run both decoders and dtypes, both widths, splits, prefetch, sinks.
_SLOW_V4 = {"v4_f32_software_prefetch_split2", "v4_tiny_bf16_native_prefetch_split3"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in _SLOW_V4 else []) for n in V4_CASES]
)
def test_fp8_v4_matches_reference(name):
    """DeepSeek-V4's rows (MODEL1: ue8m0 scales, V = K, so the rope part is a value group with its own
    output columns) and mixes of the two formats' traits, against the reference."""
    t, h, n, k, nope, rope_dim, fmt, dtype, sink, decode, config = V4_CASES[name]
    q, parts, idx, s = _fp8_inputs(len(name), t, h, n, k, nope, rope_dim, dtype, sink, fmt)
    v_dim = nope if name in _V_IS_NOPE else nope + rope_dim
    _check(q, parts, idx, s, v_dim=v_dim, config=config, fp8_decode=decode)


@pytest.mark.parametrize(
    "decode,dtype,nope,rope_dim,v4",
    [
        ("software", jnp.float32, 512, 64, False),
        ("native", jnp.bfloat16, 128, 8, False),
        ("native", jnp.float32, 448, 64, True),
        ("software", jnp.bfloat16, 24, 8, True),
        pytest.param("native", jnp.float32, 512, 64, False, marks=pytest.mark.slow),
        pytest.param("software", jnp.bfloat16, 128, 8, False, marks=pytest.mark.slow),
        pytest.param("software", jnp.float32, 448, 64, True, marks=pytest.mark.slow),
        pytest.param("native", jnp.bfloat16, 24, 8, True, marks=pytest.mark.slow),
    ],
)
def test_fp8_values_decode_exactly(decode, dtype, nope, rope_dim, v4):
    """Every e4m3 code under every scale of ``_EXTREME_SCALES`` (GLM's rows) or every ue8m0 byte of
    ``_EXTREME_E8M0`` (``v4``: DeepSeek-V4's, V = the whole row), read through the kernel bit for
    bit: q = 0 and one valid index per query make every score 0 and its weight 1, so out is the
    selected row's value part as :func:`kv_fp8.dequantize_latent` gives it (rounded once to bf16).
    The software decoder reads the NaN codes as +-480 (the kernel's docstring); they stay out of the
    native run, where one NaN would spread through the softmax. One more query selects nothing."""
    n, k = 6, 5
    codes = np.arange(256, dtype=np.uint8) if decode == "software" else _FINITE_CODES
    tile = kv_fp8.MODEL1.tile_width(nope) if v4 else kv_fp8.TILE
    values, scales, rope = _hand_latent(
        11, n, nope, rope_dim, codes, _EXTREME_E8M0 if v4 else _EXTREME_SCALES, tile
    )
    v_dim = nope + rope_dim if v4 else nope
    rng = np.random.default_rng(12)
    idx = rng.choice(np.array([-1, n, n + 7]), (n + 1, k))  # every index invalid ...
    idx[np.arange(n), rng.integers(0, k, n)] = np.arange(n)  # ... but query t's one pick of row t
    q = jnp.zeros((n + 1, 4, nope + rope_dim), dtype)
    kv, *fp8 = _fp8_parts((values, scales, rope))
    out, lse = _kernel(
        q,
        kv,
        jnp.asarray(idx, jnp.int32),
        None,
        *fp8,
        sm_scale=0.1,
        v_dim=v_dim,
        config=None,
        fp8_decode=decode,
    )
    want = np.array(kv_fp8.dequantize_latent(values, scales, rope))[:, :v_dim]
    bits = values.view(np.uint8)
    tile_scales = np.repeat(np.asarray(kv_fp8.decode_scales(jnp.asarray(scales))), tile, axis=1)
    nan_as = np.where(bits & 0x80, np.float32(-480), np.float32(480)) * tile_scales
    want[:, :nope] = np.where(np.isin(bits, _NAN_CODES), nan_as, want[:, :nope])
    want = want.astype(dtype)
    out = np.asarray(out)
    for head in range(4):
        np.testing.assert_array_equal(out[:n, head], want)
    assert (out[n] == 0).all() and np.isneginf(np.asarray(lse)[n]).all()
    np.testing.assert_array_equal(np.asarray(lse)[:n], 0.0)  # one key of score 0: log(1)


def test_fp8_software_decoder_codes():
    """The integer decoder on all 256 codes: each finite code exactly its e4m3 value, NaN as +-480."""
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(kernel._e4m3_software(jnp.asarray(codes)))
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want[list(_NAN_CODES)] = [480.0, -480.0]
    np.testing.assert_array_equal(got, want)


def test_e8m0_scale_decoder_bytes():
    """The kernel's ue8m0 decode on all 256 bytes: bit for bit :func:`kv_fp8.decode_scales` (2^(e - 127)
    for e = 1 .. 254, 0 and inf for the two bytes the writer never stores), and the writer's bytes of
    every power-of-two float32 normal round-trip."""
    e = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
    got = np.asarray(kernel._e8m0_scale(e))
    np.testing.assert_array_equal(got.view(np.uint32), np.asarray(kv_fp8.decode_scales(e)).view(np.uint32))
    np.testing.assert_array_equal(got[1:255], np.ldexp(np.float32(1), np.arange(1, 255) - 127))
    np.testing.assert_array_equal(np.asarray(kv_fp8.encode_e8m0(jnp.asarray(got[1:255]))), np.arange(1, 255))


def test_fp8_parts_are_checked():
    """The kernel and the reference refuse, with the same ValueError, every cache that is not float
    rows of the query width or FP8 parts of exactly the shapes and dtypes the dims imply (scales
    float32 or uint8, as many as divide the e4m3 part; v_dim the e4m3 part or the whole row)."""
    z, f8, f32, bf16, u8 = 8, jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16, jnp.uint8
    a = lambda shape, dtype: jnp.zeros(shape, dtype)  # noqa: E731
    good = (a((z, 512), f8), a((z, 4), f32), a((z, 64), bf16))
    bad = {
        "records": (a((z, 656), jnp.uint8), None, None),
        "fp8 rows without scales": (a((z, 576), f8), None, None),
        "rope without scales": (a((z, 576), bf16), None, a((z, 64), bf16)),
        "float values": (a((z, 512), bf16), *good[1:]),
        "values too wide": (a((z, 576), f8), *good[1:]),
        "values short": (a((z, 384), f8), a((z, 3), f32), good[2]),
        "scale width": (good[0], a((z, 5), f32), good[2]),
        "scale rows": (good[0], a((z + 1, 4), f32), good[2]),
        "scale dtype": (good[0], a((z, 4), bf16), good[2]),
        "no rope": (*good[:2], None),
        "rope width": (*good[:2], a((z, 32), bf16)),
        "rope rows": (*good[:2], a((z - 1, 64), bf16)),
        "rope dtype": (*good[:2], a((z, 64), f32)),
    }
    idx = jnp.zeros((1, 4), jnp.int32)
    for impl in (kernel.sparse_mla, ref.sparse_mla):
        # traced only (eval_shape): the checks run at trace time
        def run(d, kv, v_dim, impl=impl, **fp8):
            fn = functools.partial(impl, sm_scale=0.1, v_dim=v_dim, **fp8)
            return jax.eval_shape(fn, jnp.zeros((1, 16, d), bf16), kv, idx)

        run(576, good[0], 512, kv_scale=good[1], kv_rope=good[2])  # accepted
        for what, (kv, kv_scale, kv_rope) in bad.items():
            with pytest.raises(ValueError, match="sparse_mla: kv "):
                run(576, kv, 512, kv_scale=kv_scale, kv_rope=kv_rope)
                pytest.fail(f"{impl.__module__}: {what} accepted")
        # no rope part: no rope array
        run(128, a((z, 128), f8), 128, kv_scale=a((z, 1), f32))
        with pytest.raises(ValueError, match="kv_rope must be None"):
            run(128, a((z, 128), f8), 128, kv_scale=a((z, 1), f32), kv_rope=a((z, 0), bf16))
        # any tile that divides the e4m3 part: 96 values under one scale or three, not five
        run(96, a((z, 96), f8), 96, kv_scale=a((z, 1), f32))
        run(96, a((z, 96), f8), 96, kv_scale=a((z, 3), u8))
        with pytest.raises(ValueError, match="S dividing 96"):
            run(96, a((z, 96), f8), 96, kv_scale=a((z, 5), f32))
        # DeepSeek-V4's rows (and the tiny models'): V = the whole row, or the e4m3 part
        for nope, n_scales, rope in [(448, 7, 64), (24, 1, 8)]:
            v4 = (a((z, nope), f8), a((z, n_scales), u8), a((z, rope), bf16))
            for v_dim in (nope + rope, nope):
                run(nope + rope, v4[0], v_dim, kv_scale=v4[1], kv_rope=v4[2])
            with pytest.raises(ValueError, match="v_dim must be"):
                run(nope + rope, v4[0], nope + rope // 2, kv_scale=v4[1], kv_rope=v4[2])
        v4_bad = {
            "scales do not divide": (a((z, 448), f8), a((z, 6), u8), a((z, 64), bf16)),
            "signed scale bytes": (a((z, 448), f8), a((z, 7), jnp.int8), a((z, 64), bf16)),
            "no scales": (a((z, 448), f8), a((z, 0), u8), a((z, 64), bf16)),
            "more scales than values": (a((z, 448), f8), a((z, 896), u8), a((z, 64), bf16)),
            "scales 3-d": (a((z, 448), f8), a((z, 7, 1), u8), a((z, 64), bf16)),
            "scale rows": (a((z, 448), f8), a((z + 1, 7), u8), a((z, 64), bf16)),
            "rope width": (a((z, 448), f8), a((z, 7), u8), a((z, 128), bf16)),
            "values wider than q": (a((z, 640), f8), a((z, 10), u8), None),
        }
        for what, (kv, kv_scale, kv_rope) in v4_bad.items():
            with pytest.raises(ValueError, match="sparse_mla: kv "):
                run(512, kv, 512, kv_scale=kv_scale, kv_rope=kv_rope)
                pytest.fail(f"{impl.__module__}: {what} accepted")


def test_fp8_tuning_fits(monkeypatch):
    """FP8 rows get a config whose shared-memory estimate fits every part. At sm_90 the estimate is
    over the budget where H200 refused the tile (64 heads x 64 rows x 2 stages requested 239,872 of
    232,448 bytes) and under it where the tile built (1 stage; 32 rows x 2 stages): the measured bf16
    winner at H = 64, B = 32 keeps its tile at one stage, the others keep theirs; the FP8 warps and
    prefetch follow :func:`tuning.fp8_adjust`."""
    for cc in (0, 80, 90, 120):
        monkeypatch.setattr(tuning, "compute_capability", lambda cc=cc: cc)
        for t, h, itemsize in [
            (1, 16, 2),
            (1, 64, 2),
            (32, 64, 2),
            (128, 16, 2),
            (4096, 128, 2),
            (256, 64, 4),
        ]:
            cfg = tuning.choose(t, h, 2048, d_v=512, d_r=64, itemsize=itemsize, fp8=True)
            nbytes = tuning.smem_bytes(cfg, d_v=512, d_r=64, itemsize=itemsize, fp8=True)
            assert nbytes <= shared_memory_budget(cc), (cc, t, h, cfg)
    monkeypatch.setattr(tuning, "compute_capability", lambda: 90)
    nbytes = functools.partial(tuning.smem_bytes, d_v=512, d_r=64, itemsize=2, fp8=True)
    budget = shared_memory_budget(90)
    assert nbytes(MlaConfig(64, 64, 8, 2, 1)) >= 239872 > budget
    assert nbytes(MlaConfig(64, 64, 8, 1, 1)) <= budget and nbytes(MlaConfig(64, 32, 8, 3, 1)) <= budget
    choose = functools.partial(tuning.choose, k=2048, d_v=512, d_r=64, itemsize=2, fp8=True)

    # the H200 sweep's winners (kernels_mla_fp8-h200.md), pinned in FP8_TUNED; the rule gives them too
    want = {
        (16, 128): MlaConfig(16, 32, 4, 2, 2),  # 2 waves of 16-head programs: 4 warps, no prefetch
        (16, 32): MlaConfig(16, 32, 8, 3, 4, prefetch=True),  # one wave: prefetch (bf16's TUNED tile)
        (64, 128): MlaConfig(64, 64, 8, 1, 1),  # 64 heads: no prefetch, one stage (shared memory)
        (64, 32): dataclasses.replace(tuning.TUNED[(90, 64, 32)], num_stages=1),
    }
    assert {(h, t): cfg for (_, h, t), cfg in tuning.FP8_TUNED.items()} == want
    for fp8_tuned in (tuning.FP8_TUNED, {}):
        monkeypatch.setattr(tuning, "FP8_TUNED", fp8_tuned)
        for (h, t), cfg in want.items():
            assert choose(t, h) == cfg, (h, t, fp8_tuned)
    # one-wave grids of <= 32-head programs prefetch at the table's 8 warps
    for h, t in [(64, 1), (64, 8), (16, 1), (16, 8), (16, 64)]:
        cfg = choose(t, h)
        assert cfg.block_h <= 32 and cfg.prefetch and cfg.num_warps == 8, (h, t, cfg)


def test_fp8_v4_tuning(monkeypatch):
    """DeepSeek-V4's rows in the estimate: their real bytes per row (:meth:`kv_fp8.LatentFormat.row_bytes`;
    583 at 448 + 64, the tiny models' rope padded as the kernel pads it), GLM's estimate unchanged by
    the generalisation, and V4's tile never above GLM's (a 512-wide q and decoded tile against 576 and
    640 columns, fewer staged bytes, the same 512-column accumulator), so every V4 choice fits."""
    v4 = tuning.Fp8Rows(448, 64, 1)
    assert v4.row_bytes(64) == kv_fp8.MODEL1.row_bytes(448, 64) == 583
    assert tuning.Fp8Rows(24, 24, 1).row_bytes(8) == kv_fp8.MODEL1.row_bytes(24, 16)
    glm = tuning.Fp8Rows.ds_mla(512)
    assert glm.row_bytes(64) == kv_fp8.latent_bytes(512, 64) == 656
    for cc in (0, 80, 90, 120):
        monkeypatch.setattr(tuning, "compute_capability", lambda cc=cc: cc)
        budget = shared_memory_budget(cc)
        for t, h, itemsize in [
            (1, 64, 2),
            (32, 64, 2),
            (128, 64, 2),
            (128, 16, 2),
            (4096, 64, 2),
            (256, 64, 4),
        ]:
            cfg = tuning.choose(t, h, 512, d_v=512, d_r=64, itemsize=itemsize, fp8=v4)
            nbytes = tuning.smem_bytes(cfg, d_v=512, d_r=64, itemsize=itemsize, fp8=v4)
            assert nbytes <= budget, (cc, t, h, cfg)
            for c in (cfg, tuning.choose(t, h, 2048, d_v=512, d_r=64, itemsize=itemsize, fp8=True)):
                of = functools.partial(tuning.smem_bytes, c, d_v=512, d_r=64, itemsize=itemsize)
                assert of(fp8=True) == of(fp8=glm) and of(fp8=v4) < of(fp8=glm)


def _lower_fp8(q, kv, kv_scale, kv_rope, indices, sink=None, *, sm_scale, v_dim, fp8_decode=None):
    return kernel.sparse_mla(
        q, kv, indices, sm_scale=sm_scale, sink=sink, v_dim=v_dim, kv_scale=kv_scale, kv_rope=kv_rope,
        fp8_decode=fp8_decode,
    )  # fmt: skip


# (T, H, N, C, rope, format, q dtype, sink): decode B = 1 (K split, merge), a one-pass decode batch
# with the sink in-kernel, float32 prefill (tiles shrunk to fit), the tiny models' rows; GLM's
# (DS_MLA, V = the e4m3 part) and DeepSeek-V4's (MODEL1, V = the whole row; V4-Flash's 64 heads).
_FP8_LOWERING_SHAPES = [
    (1, 128, 262144, 512, 64, kv_fp8.DS_MLA, jnp.bfloat16, True),
    (64, 64, 262144, 512, 64, kv_fp8.DS_MLA, jnp.bfloat16, True),
    (256, 64, 65536, 512, 64, kv_fp8.DS_MLA, jnp.float32, False),
    (8, 4, 1024, 128, 8, kv_fp8.DS_MLA, jnp.bfloat16, True),
    (1, 64, 262144, 448, 64, kv_fp8.MODEL1, jnp.bfloat16, True),
    (128, 64, 262144, 448, 64, kv_fp8.MODEL1, jnp.bfloat16, False),
    (256, 64, 65536, 448, 64, kv_fp8.MODEL1, jnp.float32, True),
    (8, 4, 1024, 24, 8, kv_fp8.MODEL1, jnp.bfloat16, True),
]


@pytest.mark.parametrize("decode", [None, "software", "native"])
@pytest.mark.parametrize("target", list(_TARGET_CC))
def test_fp8_lowers_for_cuda(target, decode, monkeypatch):
    """FP8 rows (GLM's and DeepSeek-V4's) lower with either decoder on sm_90 / sm_120 and with the
    software one (also the default there) on sm_80, whose lowering has no e4m3 cast: forcing "native"
    there fails."""
    from pallas_kernels.merge_states import tuning as merge_tuning

    monkeypatch.setattr(tuning, "compute_capability", lambda: _TARGET_CC[target])
    monkeypatch.setattr(merge_tuning, "compute_capability", lambda: _TARGET_CC[target])
    for t, h, n, nope, rope_dim, fmt, dtype, with_sink in _FP8_LOWERING_SHAPES:
        v_dim = nope if fmt == kv_fp8.DS_MLA else nope + rope_dim
        args = [
            jax.ShapeDtypeStruct((t, h, nope + rope_dim), dtype),
            jax.ShapeDtypeStruct((n, nope), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n, nope // fmt.tile_width(nope)), fmt.scale_dtype),
            jax.ShapeDtypeStruct((n, rope_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((t, 2048), jnp.int32),
            *([jax.ShapeDtypeStruct((h,), jnp.float32)] if with_sink else []),
        ]
        fn = functools.partial(_lower_fp8, sm_scale=0.1, v_dim=v_dim, fp8_decode=decode)
        if target == "sm_80" and decode == "native":
            with pytest.raises(Exception, match="cannot cast from `float8_e4m3fn`"):
                lower_for_cuda(fn, *args, target=target)
        else:
            assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, *args, target=target), (t, h, nope, dtype)
