"""KDA reference ops (pallas_kernels/kda/ref.py) against HF's PyTorch functions and against themselves.

The fixture (tests/fixtures/kda/reference.npz, made by tests/reference/make_kda_reference.py) holds HF
transformers 5.23's ``recurrent_kimi_delta_attention`` / ``chunk_kimi_delta_attention`` /
``causal_conv1d_fn`` / ``causal_conv1d_update`` on random float32 inputs; HF's own float32 results are
within 4e-7 of a float64 evaluation there, so a 1e-5 bound is meaningful.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import ref

TOL = 1e-5  # rel L2, float32, against HF
# chunked vs recurrent (two float32 orders of the same math), a chunked split vs one piece: measured <= 3e-7
SELF_TOL = 1e-5

_REF = np.load(Path(__file__).resolve().parents[1] / "fixtures" / "kda" / "reference.npz")
_META = json.loads(str(_REF["meta"]))

_recurrent = jax.jit(ref.recurrent, static_argnames=("scale", "use_qk_l2norm"))
_chunked = jax.jit(ref.chunked, static_argnames=("chunk", "scale", "use_qk_l2norm"))
_conv = jax.jit(ref.causal_conv1d, static_argnames=("activation",))
_conv_update = jax.jit(ref.causal_conv1d_update, static_argnames=("activation",))


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / den) if den else float(np.linalg.norm(got))


def _arrays(name: str) -> dict[str, np.ndarray]:
    return {key.split(".", 1)[1]: _REF[key] for key in _REF.files if key.startswith(name + ".")}


# ---------------------------------------------------------------------------------------------
# against HF


def test_fixture_provenance():
    assert str(_REF["hf_version"]) == "5.23.0" and str(_REF["torch_version"]).startswith("2.13.0")
    assert _META["lower_bound"] == -5.0 and len(_META["kda"]) >= 10 and len(_META["conv"]) >= 2


@pytest.mark.parametrize("name", sorted(_META["kda"]))
def test_kda_matches_hf(name):
    """recurrent / chunked vs HF's on one case; then, where the case has one, the layer's decode chain:
    T = 1 recurrent steps from the chunked prefill's state (HF's prefill-then-decode)."""
    m, a = _META["kda"][name], _arrays(name)
    t, l2 = m["t"], m["l2norm"]
    args = [jnp.asarray(a[n][:t]) for n in ("q", "k", "v", "g", "beta")]
    state0 = a.get("state0")
    o, s = _recurrent(*args, state0, use_qk_l2norm=l2)
    oc, sc = _chunked(*args, state0, chunk=m["chunk"], use_qk_l2norm=l2)
    assert o.dtype == oc.dtype == s.dtype == sc.dtype == jnp.float32
    errs = {
        "o_rec": _rel(o, a["o_rec"]),
        "s_rec": _rel(s, a["s_rec"]),
        "o_chunk": _rel(oc, a["o_chunk"]),
        "s_chunk": _rel(sc, a["s_chunk"]),
    }
    if m["decode"]:
        outs = []
        for i in range(t, t + m["decode"]):
            step = (jnp.asarray(a[n][i : i + 1]) for n in ("q", "k", "v", "g", "beta"))
            o_i, sc = _recurrent(*step, sc, use_qk_l2norm=l2)
            outs.append(o_i)
        errs |= {"o_decode": _rel(jnp.concatenate(outs), a["o_decode"]), "s_decode": _rel(sc, a["s_decode"])}
    assert all(e <= TOL for e in errs.values()), errs


@pytest.mark.parametrize("name", sorted(_META["conv"]))
def test_conv_matches_hf(name):
    """The layer's call sequence (prefill, continued prefill, one-token updates) with the state carried
    here, against HF's outputs and cache. HF's layout is channel-major ([B, C, T]) and its cache keeps
    W columns; ours is token-major and keeps the last W-1 rows, so the cache compares as [..., 1:]."""
    m, a = _META["conv"][name], _arrays(name)
    weight, bias, act = jnp.asarray(a["weight"]), a.get("bias"), m["activation"]
    x = jnp.asarray(a["x"]).transpose(0, 2, 1)  # [B, T, C]
    prefill = jax.vmap(lambda x_b, s_b: _conv(x_b, weight, bias, s_b, activation=act))
    state, ys, pos = None, [], 0
    for n, kind, hf_cache in zip(m["segments"], m["kinds"], a["cache"]):
        x_i = x[:, pos : pos + n]
        if kind == "update":
            y_i, state = _conv_update(x_i[:, 0], weight, bias, state, activation=act)
            y_i = y_i[:, None]
        elif state is None:  # the first prefill: no cache yet (HF pads with zeros)
            y_i, state = jax.vmap(lambda x_b: _conv(x_b, weight, bias, activation=act))(x_i)
        else:
            y_i, state = prefill(x_i, state)
        np.testing.assert_array_equal(np.asarray(state), hf_cache[:, :, 1:].transpose(0, 2, 1))
        ys.append(y_i)
        pos += n
    assert _rel(jnp.concatenate(ys, axis=1), a["y"].transpose(0, 2, 1)) <= TOL


# ---------------------------------------------------------------------------------------------
# self-consistency on fresh random inputs


def _random_kda(seed: int, t: int, h: int = 2, dk: int = 16, dv: int = 32):
    """Unnormalized q / k (the functions normalize), g in (-5, 0) with per-channel rates from near 0 to
    near the bound (as the forget gate gives), beta in (0, 1), a random float32 state."""
    kq, kk, kv, kg, kr, kb, ks = jax.random.split(jax.random.key(seed), 7)
    rate = jax.random.uniform(kr, (h, dk), minval=-8.0, maxval=4.0)
    g = -5.0 * jax.nn.sigmoid(rate + jax.random.normal(kg, (t, h, dk)))
    return (
        jax.random.normal(kq, (t, h, dk)),
        jax.random.normal(kk, (t, h, dk)),
        jax.random.normal(kv, (t, h, dv)),
        g,
        jax.nn.sigmoid(jax.random.normal(kb, (t, h))),
        jax.random.normal(ks, (h, dk, dv)),
    )


@pytest.mark.parametrize("t,chunk", [(100, 64), (37, 16)])
def test_chunked_equals_recurrent(t, chunk):
    *args, s0 = _random_kda(1, t)
    o, s = _recurrent(*args, s0)
    oc, sc = _chunked(*args, s0, chunk=chunk)
    assert _rel(oc, o) <= SELF_TOL and _rel(sc, s) <= SELF_TOL


def test_split_prefill_carries_state():
    """Two pieces with the state carried = one piece: recurrent and chunked (cut off a chunk boundary)."""
    *args, s0 = _random_kda(2, 100)
    first, second = ([x[:41] for x in args], [x[41:] for x in args])
    o, s = _recurrent(*args, s0)
    o1, s1 = _recurrent(*first, s0)
    o2, s2 = _recurrent(*second, s1)
    np.testing.assert_allclose(np.concatenate([o1, o2]), o, rtol=0, atol=1e-6 * np.abs(o).max())
    np.testing.assert_allclose(s2, s, rtol=0, atol=1e-6 * np.abs(s).max())
    oc, sc = _chunked(*args, s0)
    oc1, sc1 = _chunked(*first, s0)
    oc2, sc2 = _chunked(*second, sc1)
    assert _rel(jnp.concatenate([oc1, oc2]), oc) <= SELF_TOL and _rel(sc2, sc) <= SELF_TOL


def test_decode_is_last_step():
    """One token through recurrent from the state of the first T-1 = the last row of a T-token run."""
    *args, s0 = _random_kda(3, 70)
    o, s = _recurrent(*args, s0)
    _, s_prev = _recurrent(*(x[:-1] for x in args), s0)
    o_last, s_last = _recurrent(*(x[-1:] for x in args), s_prev)
    np.testing.assert_allclose(o_last[0], o[-1], rtol=0, atol=1e-6 * np.abs(o).max())
    np.testing.assert_allclose(s_last, s, rtol=0, atol=1e-6 * np.abs(s).max())
    _, sc_prev = _chunked(*(x[:-1] for x in args), s0)  # the layer's way: chunked prefill, then decode
    oc_last, _ = _recurrent(*(x[-1:] for x in args), sc_prev)
    assert _rel(oc_last[0], o[-1]) <= SELF_TOL


def test_conv_split_and_decode():
    """Prefill in two pieces = one piece = token-by-token updates (bit for bit: the same products)."""
    kx, kw, kb = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(kx, (11, 24))
    weight, bias = jax.random.normal(kw, (24, 4)), jax.random.normal(kb, (24,))
    y, s = _conv(x, weight, bias, activation="silu")
    y1, s1 = _conv(x[:2], weight, bias, activation="silu")  # shorter than the W-1 state rows
    y2, s2 = _conv(x[2:], weight, bias, s1, activation="silu")
    np.testing.assert_array_equal(np.concatenate([y1, y2]), y)
    np.testing.assert_array_equal(s2, s)
    np.testing.assert_array_equal(s, x[-3:])
    state, ys = jnp.zeros((1, 3, 24)), []
    for x_t in x:
        y_t, state = _conv_update(x_t[None], weight, bias, state, activation="silu")
        ys.append(y_t[0])
    np.testing.assert_array_equal(np.stack(ys), y)
    np.testing.assert_array_equal(state[0], s)


def test_empty_sequence():
    """T = 0 is a no-op, as HF's functions make it (the fixture's t0_state case): an empty output and
    the state as given (zeros when None)."""
    *args, s0 = _random_kda(5, 0)
    for fn in (_recurrent, _chunked):
        o, s = fn(*args, s0)
        assert o.shape == (0, 2, 32)
        np.testing.assert_array_equal(s, s0)
        assert not np.asarray(fn(*args)[1]).any()
    state = jnp.arange(3 * 8, dtype=jnp.float32).reshape(3, 8)
    y, s = _conv(jnp.zeros((0, 8)), jnp.ones((8, 4)), None, state, activation="silu")
    assert y.shape == (0, 8)
    np.testing.assert_array_equal(s, state)


def test_l2norm_eps_inside_sqrt():
    x = jnp.array([[3.0, 4.0], [0.0, 0.0], [1e-4, 0.0]])
    want = np.array([[3.0, 4.0], [0.0, 0.0], [1e-4, 0.0]]) / np.sqrt([[25 + 1e-6], [1e-6], [1e-8 + 1e-6]])
    np.testing.assert_allclose(ref.l2norm(x, 1e-6), want, rtol=1e-6)


def test_dtypes_and_rejections():
    """bf16 inputs: the output comes back in bf16, the state stays float32. Shapes that do not fit and an
    activation HF's layer never uses are refused by name."""
    *args, _ = _random_kda(6, 5)
    o, s = _recurrent(*(x.astype(jnp.bfloat16) for x in args))
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    q, k, v, g, beta = args
    with pytest.raises(ValueError, match="beta"):
        ref.recurrent(q, k, v, g, beta[:, :1])
    with pytest.raises(ValueError, match="state"):
        ref.chunked(q, k, v, g, beta, jnp.zeros((2, 16, 16)))
    with pytest.raises(ValueError, match="activation"):
        ref.causal_conv1d(jnp.zeros((3, 8)), jnp.ones((8, 4)), None, activation="gelu")
    with pytest.raises(ValueError, match="state"):
        ref.causal_conv1d(jnp.zeros((3, 8)), jnp.ones((8, 4)), None, jnp.zeros((4, 8)), activation="silu")
