"""Indexer-logits Pallas kernels vs the float32 reference (CPU, interpret mode) + CUDA lowering.

Interpret mode runs the real kernel bodies on the CPU one grid step at a time, so shapes stay small
and small block sizes are forced through ``config`` to get many tiles (ragged edges, causal skips,
mixed-sequence tiles). Production shapes are only lowered (Pallas -> Triton IR), which catches what
the interpreter forgives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdsa import ops
from pallas_kernels._triton import lower_for_cuda
from pallas_kernels.indexer_logits import kernel, ref
from pallas_kernels.indexer_logits.tuning import IndexerConfig, RowConfig, TileConfig

D = 128
SMALL = IndexerConfig(
    row=RowConfig(block_s=32, steps=2), tile=TileConfig(block_t=16, block_s=32), tile_min_queries_per_seq=1
)


def _qw(rng, t, hi, dtype=jnp.bfloat16):
    q = jnp.asarray(rng.standard_normal((t, hi, D)), dtype)
    w = jnp.asarray(rng.standard_normal((t, hi)), jnp.float32)
    return q, w


def _pool(rng, batch, pages_per_seq, page, *, spare=3):
    """Random key pages and a page table that scatters each sequence's pages over the pool."""
    n_pages = batch * pages_per_seq + spare
    k_pages = jnp.asarray(rng.standard_normal((n_pages, page, D)), jnp.bfloat16)
    table = jnp.asarray(
        rng.permutation(n_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq), jnp.int32
    )
    return k_pages, table


def _fp8(rng, k_pages):
    """e4m3 keys (values spread over the whole e4m3 range, incl. subnormals) and positive scales."""
    mag = np.exp2(rng.uniform(-8.0, 8.5, k_pages.shape)) * np.sign(rng.standard_normal(k_pages.shape))
    k8 = jnp.asarray(mag, jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(1e-3, 2e-2, k_pages.shape[:2]), jnp.float32)
    return k8, scale


def _assert_close(got, want, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert np.isfinite(got[~np.isneginf(want)]).all()
    finite = np.isfinite(want)
    rel = np.linalg.norm(got[finite] - want[finite]) / max(np.linalg.norm(want[finite]), 1e-30)
    assert rel <= tol, rel


@pytest.mark.parametrize(
    "t, s, hi, dtype, config",
    [
        (80, 300, 16, jnp.bfloat16, SMALL),  # tile path: ragged T and S, causal skip of key blocks
        (70, 200, 32, jnp.bfloat16, None),  # tile path, production block sizes, through jaxdsa.ops
        (1, 300, 64, jnp.float32, SMALL),  # row path; f32 inputs take exact (not TF32) dots
        (2048, 48, 16, jnp.bfloat16, None),  # thousands of queries, S below one block
        (3, 300, 4, jnp.float32, SMALL),  # row path, 4 heads (a TP = 8 shard) padded to 16
        (80, 300, 8, jnp.bfloat16, SMALL),  # tile path, 8 heads (TP = 4)
    ],
)
def test_flat_matches_reference(t, s, hi, dtype, config):
    rng = np.random.default_rng(t + s + hi)
    q, w = _qw(rng, t, hi, dtype)
    k = jnp.asarray(rng.standard_normal((s, D)), dtype)
    # the causal tail of a prompt (later queries see more keys), every 7th query anywhere (or none)
    q_pos = np.clip(s - t + np.arange(t), -1, None) if t <= s else rng.integers(0, s, t)
    q_pos[::7] = rng.integers(-1, s, len(q_pos[::7]))
    q_pos = jnp.asarray(q_pos, jnp.int32)
    got = kernel.indexer_logits(q, w, k, q_pos=q_pos, interpret=True, config=config)  # None: the table
    _assert_close(got, ref.indexer_logits(q, w, k, q_pos=q_pos), tol=1e-6 if dtype == jnp.float32 else 1e-5)


def test_paged_decode_ragged_lengths_and_padding():
    """One query per sequence (row kernel, production block size, dispatched through jaxdsa.ops),
    ragged lengths, a padding query, an unset page-table tail."""
    rng = np.random.default_rng(5)
    batch, m, page = 5, 6, 16
    k_pages, table = _pool(rng, batch, m, page)
    table = table.at[1, 3:].set(-1)  # sequence 1 is short: its table tail is unset
    seq_ids = jnp.asarray([3, 1, -1, 0, 4, 2], jnp.int32)
    q_pos = jnp.asarray([95, 40, 50, 0, 63, 17], jnp.int32)
    q, w = _qw(rng, 6, 32)
    got = ops._impl("indexer_logits_paged", "interpret")(q, w, k_pages, table, seq_ids, q_pos, k_scale=None)
    _assert_close(got, ref.indexer_logits_paged(q, w, k_pages, table, seq_ids, q_pos))
    assert np.isneginf(np.asarray(got[2])).all()  # padding query


def test_paged_prefill_packed_batch():
    """Packed prefill: runs of one sequence (uniform tiles) next to single decode tokens and
    padding (mixed tiles fall back to per-query rows); queries per sequence are causal."""
    rng = np.random.default_rng(0)
    batch, m, page = 4, 5, 16
    k_pages, table = _pool(rng, batch, m, page)
    runs = [(2, 37), (0, 1), (3, 1), (1, 22)]  # (sequence, number of new tokens)
    seq_ids, q_pos = [], []
    for seq, n in runs:
        start = int(rng.integers(0, m * page - n))
        seq_ids += [seq] * n
        q_pos += list(range(start, start + n))
    seq_ids += [-1] * 3
    q_pos += [5, 0, 70]
    seq_ids, q_pos = jnp.asarray(seq_ids, jnp.int32), jnp.asarray(q_pos, jnp.int32)
    q, w = _qw(rng, len(seq_ids), 64)
    got = kernel.indexer_logits_paged(q, w, k_pages, table, seq_ids, q_pos, interpret=True, config=SMALL)
    _assert_close(got, ref.indexer_logits_paged(q, w, k_pages, table, seq_ids, q_pos))


@pytest.mark.parametrize("native_fp8, tiles", [(True, False), (False, True)])
def test_paged_fp8_keys(native_fp8, tiles):
    """float8_e4m3fn keys + per-row scales: the in-kernel cast (sm_89+) and the integer decode used
    on sm_80/86 (both share the key gather; each kernel applies the scales itself)."""
    rng = np.random.default_rng(11)
    batch, m, page = 3, 4, 16
    k_pages, table = _pool(rng, batch, m, page)
    k8, scale = _fp8(rng, k_pages)
    t = 40 if tiles else 4
    seq_ids = jnp.asarray(np.sort(rng.integers(0, batch, t)), jnp.int32)
    q_pos = jnp.asarray(rng.integers(0, m * page, t), jnp.int32)
    q, w = _qw(rng, t, 16)
    got = kernel.indexer_logits_paged(
        q, w, k8, table, seq_ids, q_pos, k_scale=scale, interpret=True, native_fp8=native_fp8, config=SMALL
    )
    _assert_close(got, ref.indexer_logits_paged(q, w, k8, table, seq_ids, q_pos, k_scale=scale))


def test_e4m3_integer_decode_is_exact():
    """Every finite e4m3fn code (normals and subnormals) decodes to its value times 2**-8."""
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(kernel._e4m3_bits_to_f16(jnp.asarray(codes)), np.float32) * 256.0
    np.testing.assert_array_equal(got, want)


# --- CUDA lowering at production shapes (no GPU needed) ------------------------------------

_sd = jax.ShapeDtypeStruct
_PROD = dict(hi=64, s=131072, page=64)


def _lower_flat(target):
    t, hi, s = 4096, _PROD["hi"], _PROD["s"]
    return lower_for_cuda(
        lambda q, w, k, p: kernel.indexer_logits(q, w, k, q_pos=p),
        _sd((t, hi, D), jnp.bfloat16),
        _sd((t, hi), jnp.float32),
        _sd((s, D), jnp.bfloat16),
        _sd((t,), jnp.int32),
        target=target,
    )


def _lower_paged(target, *, t, batch, fp8, native_fp8=None):
    hi, page = _PROD["hi"], _PROD["page"]
    m = _PROD["s"] // page
    n_pages = batch * m
    key_dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16

    def fn(q, w, k_pages, scale, table, seq_ids, q_pos):
        return kernel.indexer_logits_paged(
            q, w, k_pages, table, seq_ids, q_pos, k_scale=scale if fp8 else None, native_fp8=native_fp8
        )

    return lower_for_cuda(
        fn,
        _sd((t, hi, D), jnp.bfloat16),
        _sd((t, hi), jnp.float32),
        _sd((n_pages, page, D), key_dtype),
        _sd((n_pages, page), jnp.float32),
        _sd((batch, m), jnp.int32),
        _sd((t,), jnp.int32),
        _sd((t,), jnp.int32),
        target=target,
    )


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_120"])
def test_lowers_for_cuda(target):
    """Flat prefill, paged decode (row kernel), paged prefill on one sequence (tile kernel), and both
    with fp8 keys (on sm_80 the default is the integer e4m3 decode)."""
    assert "__gpu$xla.gpu.triton" in _lower_flat(target)
    for fp8 in (False, True):
        _lower_paged(target, t=32, batch=32, fp8=fp8)
        _lower_paged(target, t=4096, batch=1, fp8=fp8)


@pytest.mark.parametrize("hi", [4, 8])
def test_lowers_float32_tensor_parallel_heads(hi):
    """A 32-head indexer at TP = 8 / 4 in float32: padded heads in the row kernel, the tile kernel
    (with its per-query row fallback) at the float32-fitted sizes."""
    m = 1024 // 64  # pages of 64 keys per sequence
    for t, batch in ((32, 32), (4096, 1)):
        text = lower_for_cuda(
            lambda q, w, k, table, seq, pos: kernel.indexer_logits_paged(q, w, k, table, seq, pos),
            _sd((t, hi, D), jnp.float32),
            _sd((t, hi), jnp.float32),
            _sd((batch * m, 64, D), jnp.float32),
            _sd((batch, m), jnp.int32),
            _sd((t,), jnp.int32),
            _sd((t,), jnp.int32),
            target="sm_90",
        )
        assert "__gpu$xla.gpu.triton" in text


def test_native_e4m3_cast_does_not_lower_on_sm80():
    """Why sm_80/86 need the integer decode: Triton has no e4m3 cast below sm_89."""
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        _lower_paged("sm_80", t=32, batch=32, fp8=True, native_fp8=True)
