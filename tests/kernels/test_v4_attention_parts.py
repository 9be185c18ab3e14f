"""DeepSeek-V4 attention through the shared kernels, interpret mode vs a dense NumPy oracle.

One shared 512-wide K = V row per key (``sparse_mla(..., v_dim=512)``), a window subset and a
compressed subset per query attended separately, then ``merge_states`` with the per-head sink once.
The oracle is a single softmax over window keys + selected entries + the sink logit. Fresh random
inputs include queries with an empty compressed selection (all -1, as before the first complete
window), padded -1 picks, and the CSA indexer's "last visible entry" -1 (nothing complete yet).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa import ops

H, D = 4, 512


@pytest.fixture(scope="module")
def backend():
    """The kernels in interpret mode (the reference ops are covered by the model's HF parity)."""
    previous = ops.get_kernels()
    ops.set_kernels("interpret")
    yield "interpret"
    ops.set_kernels(previous)


def _oracle(q, window_kv, win_idx, entries, cmp_idx, sink, scale):
    t = q.shape[0]
    out = np.zeros((t, H, D))
    for i in range(t):
        keys = [window_kv[j] for j in win_idx[i] if j >= 0] + [entries[j] for j in cmp_idx[i] if j >= 0]
        k = np.stack(keys).astype(np.float64) if keys else np.zeros((0, D))
        logits = q[i].astype(np.float64) @ k.T * scale  # [H, keys]
        m = np.maximum(logits.max(axis=1) if k.shape[0] else -np.inf, sink)
        p = np.exp(logits - m[:, None])
        out[i] = p @ k / (p.sum(axis=1) + np.exp(sink - m))[:, None]
    return out


def test_window_plus_compressed_with_sink(backend):
    t, window, ratio = 11, 4, 4
    ks = jax.random.split(jax.random.key(0), 5)
    q = np.asarray(jax.random.normal(ks[0], (t, H, D), jnp.float32))
    kv = np.asarray(jax.random.normal(ks[1], (t, D), jnp.float32))
    entries = np.asarray(jax.random.normal(ks[2], (t // ratio, D), jnp.float32))
    sink = np.asarray(jax.random.normal(ks[3], (H,), jnp.float32))
    pos = np.arange(t)
    win_idx = pos[:, None] - window + 1 + np.arange(window)[None, :]
    win_idx = np.where(win_idx >= 0, win_idx, -1).astype(np.int32)
    # compressed picks: entries j < (p + 1) // m in shuffled order, -1 padding; rows 0..2 see none
    rng = np.random.default_rng(1)
    cmp_idx = np.full((t, 3), -1, np.int32)
    for i in range(t):
        visible = rng.permutation((i + 1) // ratio)[:3]
        cmp_idx[i, : len(visible)] = visible
    scale = D**-0.5

    @jax.jit
    def attend(q, kv, win_idx, entries, cmp_idx, sink):
        parts = [
            ops.sparse_mla(q, kv, win_idx, sm_scale=scale, v_dim=D),
            ops.sparse_mla(q, entries, cmp_idx, sm_scale=scale, v_dim=D),
        ]
        outs, lses = zip(*parts)
        return ops.merge_states(jnp.stack(outs), jnp.stack(lses), sink=sink)[0], lses[1]

    out, cmp_lse = attend(q, kv, win_idx, entries, cmp_idx, sink)
    assert not np.isfinite(np.asarray(cmp_lse)[:3]).any()  # empty compressed subsets: lse -inf
    want = _oracle(q, kv, win_idx, entries, cmp_idx, sink, scale)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6)


def test_indexer_before_the_first_complete_entry(backend):
    """Queries whose last visible entry is -1 select nothing; later ones pick among complete entries."""
    t, n_heads, dim, ratio, topk = 9, 16, 16, 4, 2
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (t, n_heads, dim), jnp.float32)
    w = jax.random.normal(ks[1], (t, n_heads), jnp.float32)
    keys = jax.random.normal(ks[2], (t // ratio, dim), jnp.float32)
    last_visible = (jnp.arange(t) + 1) // ratio - 1
    select = jax.jit(lambda q, w, k, p: ops.topk_indices(ops.indexer_logits(q, w, k, q_pos=p), topk))
    picked = np.asarray(select(q, w, keys, last_visible))
    for i, row in enumerate(picked):
        complete = (i + 1) // ratio
        assert sorted(x for x in row if x >= 0) == sorted(set(x for x in row if x >= 0))
        assert (row[row >= 0] < complete).all() and (row >= 0).sum() == min(topk, complete)
