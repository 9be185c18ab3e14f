"""Sparse-MLA Pallas kernel vs the float32 reference (CPU, interpret mode) + CUDA lowering.

Interpret mode runs the real kernel body on the CPU one grid step at a time, so shapes stay
small; the production shapes are only lowered (Pallas -> Triton IR), which is cheap and catches
what the interpreter forgives (non-power-of-two tiles, unsupported primitives).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._triton import lower_for_cuda, sm_count
from pallas_kernels.sparse_mla import kernel, ref, tuning
from pallas_kernels.sparse_mla.tuning import MlaConfig


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_dim", "config"))
def _kernel(q, kv, indices, sink, *, sm_scale, v_dim, config):
    return kernel.sparse_mla(
        q, kv, indices, sm_scale=sm_scale, sink=sink, v_dim=v_dim, interpret=True, config=config
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


def _check(q, kv, idx, s, *, v_dim, config=None, scale=0.1):
    out, lse = _kernel(q, kv, idx, s, sm_scale=scale, v_dim=v_dim, config=config)
    want_out, want_lse = _reference(
        q.astype(jnp.float32), kv.astype(jnp.float32), idx, sm_scale=scale, sink=s, v_dim=v_dim
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


def _lower_target(q, kv, indices, sink=None, *, sm_scale, v_dim):
    return kernel.sparse_mla(q, kv, indices, sm_scale=sm_scale, sink=sink, v_dim=v_dim)
