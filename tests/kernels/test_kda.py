"""KDA Pallas kernels (decode step, chunked prefill) vs pallas_kernels/kda/ref.py (CPU, interpret mode)
+ CUDA lowering at GLM-5.3-Flash's widths.

The refs are proven equal to HF (tests/kernels/test_kda_ref.py). Inputs are fresh random draws: gates as
GLM's forget gate makes them, ``g = -5 sigmoid(x)`` (``linear_lower_bound`` -5), ``beta = sigmoid(x)``.
Interpret mode runs the prefill's dots as emulated TF32x3 (the GPU's arithmetic) unless a case asks for
IEEE ones. Measured: rel L2 <= 7e-7 for float32 outputs and states (decode and prefill, both dot modes).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._triton import lower_for_cuda, shared_memory_budget
from pallas_kernels.kda import kernel, ref, tuning

TOL = 2e-6  # rel L2, float32 results (measured <= 7e-7)
BF16_OUT_TOL = 1e-3  # bf16 outputs (measured <= 3e-5): two float32 o, each rounded to bf16

# Interpret-mode kernels are large programs run once or twice: XLA's CPU backend at optimization level 0
# compiles them (and the refs) in about half the time, which is most of this file's time.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
_step = _jit(functools.partial(kernel.recurrent_step, interpret=True))
_packed = _jit(functools.partial(kernel.recurrent_packed, interpret=True))
_ref_packed = _jit(ref.recurrent_packed)
_prefill = _jit(kernel.chunked, static_argnames=("chunk", "interpret", "config"))
_ref_chunked = _jit(ref.chunked, static_argnames=("chunk",))
_ref_recurrent = _jit(ref.recurrent)
_ref_decode = _jit(
    jax.vmap(lambda q, k, v, g, beta, s: ref.recurrent(q[None], k[None], v[None], g[None], beta[None], s))
)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _inputs(seed, lead, h, dk, dv, dtype, lower_bound=-5.0):
    """q, k, v in ``dtype``, g and beta float32, with leading axes ``lead`` ((T,) or (B,))."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k = (jax.random.normal(key, (*lead, h, dk), jnp.float32).astype(dtype) for key in ks[:2])
    v = jax.random.normal(ks[2], (*lead, h, dv), jnp.float32).astype(dtype)
    g = lower_bound * jax.nn.sigmoid(jax.random.normal(ks[3], (*lead, h, dk), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (*lead, h), jnp.float32))
    return q, k, v, g, beta


def _state(seed, shape):
    return 0.5 * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _o_tol(dtype) -> float:
    return BF16_OUT_TOL if dtype == jnp.bfloat16 else TOL


def _check_o(o, want, dtype):
    assert o.dtype == dtype and np.isfinite(np.asarray(o, np.float32)).all()
    assert _rel(o, want) <= _o_tol(dtype)


# ---------------------------------------------------------------------------------------------
# decode

# (B, H, K, V, dtype, valid): K = 24 and V = 40 are padded to 32 / 64 with masks (two V tiles of 32).
DECODE = {
    "b1_f32": (1, 2, 24, 40, jnp.float32, None),
    "b4_bf16_padded_row": (4, 2, 24, 40, jnp.bfloat16, (True, False, True, True)),
    "b3_f32_padded_tail": (3, 3, 32, 32, jnp.float32, (True, True, False)),
}


@pytest.mark.parametrize("name", list(DECODE))
def test_decode_matches_reference(name):
    b, h, dk, dv, dtype, valid = DECODE[name]
    q, k, v, g, beta = _inputs(len(name), (b,), h, dk, dv, dtype)
    state = _state(b, (b, h, dk, dv))
    mask = None if valid is None else jnp.asarray(valid)
    o, new = _step(q, k, v, g, beta, state, valid=mask)
    want_o, want_s = _ref_decode(q, k, v, g, beta, state)
    assert o.shape == (b, h, dv) and o.dtype == dtype and new.dtype == jnp.float32
    o, new, want_o, want_s, state = (np.asarray(x, np.float32) for x in (o, new, want_o, want_s, state))
    live = np.ones(b, bool) if valid is None else np.asarray(valid)
    assert not o[~live].any()
    np.testing.assert_array_equal(new[~live], state[~live])  # padding rows: state untouched
    assert np.isfinite(o).all() and _rel(o[live], want_o[live, 0]) <= _o_tol(dtype)
    assert _rel(new[live], want_s[live]) <= TOL


# packed steps: several sequences, each a run of tokens, states in rows of a buffer

# seq_ids of a packed step (-1 padding) over S = 4 sequences (sequence 3 has no token in it) and where
# their states live in a buffer of 8 rows; sequence 0 starts fresh (its tokens begin at position 0).
PACKED_SEQ_IDS = (0, 0, 0, 2, 1, 1, 1, 1, 1, 1, 1, -1, -1)
PACKED_ROWS, PACKED_FRESH = (5, 0, 3, 7), (True, False, False, False)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_matches_reference_and_each_sequence_alone(dtype):
    """Kernel == ref over ragged runs, a padded tail and an absent sequence; the ref == :func:`ref.recurrent`
    of each sequence alone from its own row (or zeros when fresh); rows no sequence owns are untouched."""
    seq_ids = jnp.asarray(PACKED_SEQ_IDS, jnp.int32)
    rows, fresh = jnp.asarray(PACKED_ROWS, jnp.int32), jnp.asarray(PACKED_FRESH)
    args = _inputs(3, (len(PACKED_SEQ_IDS),), H, DK, DV, dtype)
    state = _state(2, (8, H, DK, DV))
    o, new = _packed(*args, state, seq_ids=seq_ids, rows=rows, fresh=fresh)
    want_o, want_s = _ref_packed(*args, state, seq_ids=seq_ids, rows=rows, fresh=fresh)
    _check_o(o, want_o, dtype)
    assert new.dtype == jnp.float32 and _rel(new, want_s) <= TOL
    ids = np.asarray(PACKED_SEQ_IDS)
    assert not np.asarray(o, np.float32)[ids < 0].any()
    for seq in range(3):
        at = ids == seq
        start = None if PACKED_FRESH[seq] else state[PACKED_ROWS[seq]]
        alone_o, alone_s = _ref_recurrent(*(x[at] for x in args), start)
        assert _rel(want_o[at], alone_o) <= TOL and _rel(want_s[PACKED_ROWS[seq]], alone_s) <= TOL
    untouched = [r for r in range(8) if r not in PACKED_ROWS[:3]]
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(state)[untouched])


def test_packed_long_run_equals_chunked_prefill():
    """One sequence of 130 tokens from a cached state (a prefill chunk): the packed recurrence == the
    chunked ref (HF's prefill), up to float32 rounding."""
    args = _inputs(9, (130,), H, DK, DV, jnp.float32)
    state = _state(4, (2, H, DK, DV))
    one = jnp.ones((1,), jnp.int32)
    o, new = _packed(
        *args, state, seq_ids=jnp.zeros((130,), jnp.int32), rows=one, fresh=jnp.zeros((1,), bool)
    )
    want_o, want_s = _ref_chunked(*args, state[1])
    assert _rel(o, want_o) <= TOL and _rel(new[1], want_s) <= TOL
    np.testing.assert_array_equal(np.asarray(new[0]), np.asarray(state[0]))


# ---------------------------------------------------------------------------------------------
# prefill

# (T, dtype, initial state): every ragged / whole chunk count around 64, both dtypes. H = 2, K = 24
# (padded to 32), V = 80 (two V tiles of 64, the second ragged).
PREFILL = {
    "t1_f32_state": (1, jnp.float32, True),
    "t5_bf16": (5, jnp.bfloat16, False),
    "t63_f32": (63, jnp.float32, False),
    "t64_bf16_state": (64, jnp.bfloat16, True),
    "t65_f32_state": (65, jnp.float32, True),
    "t130_f32": (130, jnp.float32, False),
    "t130_bf16_state": (130, jnp.bfloat16, True),
}
H, DK, DV = 2, 24, 80


@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_matches_reference(name):
    t, dtype, with_state = PREFILL[name]
    args = _inputs(len(name), (t,), H, DK, DV, dtype)
    state = _state(t, (H, DK, DV)) if with_state else None
    o, final = _prefill(*args, state, interpret=True)
    want_o, want_s = _ref_chunked(*args, state)
    _check_o(o, want_o, dtype)
    assert final.dtype == jnp.float32 and _rel(final, want_s) <= TOL


@pytest.mark.parametrize("chunk, dot", [(16, "ieee"), (128, "tf32x3")])
def test_prefill_other_chunks_and_ieee_dots(chunk, dot):
    """Chunk 16 (one sub-chunk: no off-diagonal dots), 128 (eight: three nilpotent factors), IEEE dots,
    against the ref at the same chunk (the cumulative decay's rounding grows with the chunk)."""
    args = _inputs(chunk, (150,), H, DK, DV, jnp.float32)
    state = _state(1, (H, DK, DV))
    cfg = tuning.KdaConfig(block_v=32, num_warps=8, num_stages=1, dot=dot)
    o, final = _prefill(*args, state, chunk=chunk, interpret=True, config=cfg)
    want_o, want_s = _ref_chunked(*args, state, chunk=chunk)
    assert _rel(o, want_o) <= TOL and _rel(final, want_s) <= TOL


def test_prefill_strong_decay_stays_finite():
    """g down to -100 a step (G to -6400 in a chunk): every exponent the kernel takes is <= 0."""
    args = _inputs(7, (100,), H, 32, 32, jnp.float32, lower_bound=-100.0)
    o, final = _prefill(*args, None, interpret=True)
    want_o, want_s = _ref_recurrent(*args)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(final)).all()
    assert _rel(o, want_o) <= TOL and _rel(final, want_s) <= TOL


def test_prefill_then_decode_continues_the_sequence():
    """Prefill 70 tokens, then three decode steps from its final state (in a batch of 2 with a padding
    row) == the ref's recurrence over all 73 tokens."""
    dk, dv = 32, 48
    q, k, v, g, beta = _inputs(11, (73,), H, dk, dv, jnp.float32)
    state0 = _state(5, (H, dk, dv))
    o, state = _prefill(q[:70], k[:70], v[:70], g[:70], beta[:70], state0, interpret=True)
    outs = [o]
    batch = jnp.stack([state, jnp.zeros_like(state)])
    valid = jnp.asarray([True, False])
    for i in range(70, 73):
        step = (jnp.stack([x[i], jnp.zeros_like(x[i])]) for x in (q, k, v, g, beta))
        o_i, batch = _step(*step, batch, valid=valid)
        outs.append(o_i[:1])
    want_o, want_s = _ref_recurrent(q, k, v, g, beta, state0)
    assert _rel(jnp.concatenate(outs), want_o) <= TOL and _rel(batch[0], want_s) <= TOL
    assert not np.asarray(batch[1]).any()


def test_tf32x3_emulation_is_float32_accurate():
    """The interpret-mode TF32x3 emulation is not a no-op: one TF32 product is 1e-4-accurate, the three
    products float32-accurate (both vs float64)."""
    a, b = (jax.random.normal(key, (64, 128), jnp.float32) for key in jax.random.split(jax.random.key(0)))
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    x3 = kernel._dot_nt(a, b, "tf32x3_emulated")
    one = kernel._dot_nt(kernel._tf32(a, rounded=True), kernel._tf32(b, rounded=True), "ieee")
    assert _rel(x3, exact) <= 1e-6 < 1e-4 <= _rel(one, exact)


# ---------------------------------------------------------------------------------------------
# lowering

# GLM-5.3-Flash (HF glm5_next): linear_num_heads 64, linear_head_dim 128 for K and V.
GLM53_H, GLM53_D = 64, 128
_TARGET_CC = {"sm_80": 80, "sm_90": 90, "sm_120": 120}
_S = jax.ShapeDtypeStruct


def _aliased_operand(text: str) -> int:
    """The operand the Triton call's output 1 (the state) aliases."""
    found = re.findall(r"output_tuple_indices = \[1\], operand_index = (\d+)", text)
    assert len(found) == 1, found
    return int(found[0])


def _operands(lead, dtype):
    d = GLM53_D
    return [
        _S((*lead, GLM53_H, d), dtype),
        _S((*lead, GLM53_H, d), dtype),
        _S((*lead, GLM53_H, d), dtype),
        _S((*lead, GLM53_H, d), jnp.float32),
        _S((*lead, GLM53_H), jnp.float32),
    ]


@pytest.mark.parametrize("target", list(_TARGET_CC))
def test_lowers_for_cuda(target, monkeypatch):
    cc = _TARGET_CC[target]
    monkeypatch.setattr(tuning, "compute_capability", lambda: cc)
    d = GLM53_D
    for b, dtype in [(1, jnp.bfloat16), (64, jnp.float32)]:
        state = _S((b, GLM53_H, d, d), jnp.float32)
        text = lower_for_cuda(kernel.recurrent_step, *_operands((b,), dtype), state, target=target)
        assert _aliased_operand(text) == 9
    for t, s in [(4096, 1), (64, 64)]:  # a long prefill run; a decode step of 64 sequences
        packed = lambda *a: kernel.recurrent_packed(*a[:6], seq_ids=a[6], rows=a[7], fresh=a[8])  # noqa: E731
        state = _S((2 * s, GLM53_H, d, d), jnp.float32)
        ids, seqs = _S((t,), jnp.int32), _S((s,), jnp.int32)
        text = lower_for_cuda(packed, *_operands((t,), jnp.bfloat16), state, ids, seqs, seqs, target=target)
        assert _aliased_operand(text) == 9
    for t, dtype in [(4096, jnp.bfloat16), (65, jnp.float32)]:
        state = _S((GLM53_H, d, d), jnp.float32)
        text = lower_for_cuda(kernel.chunked, *_operands((t,), dtype), state, target=target)
        assert _aliased_operand(text) == 5
    cfg = tuning.choose_prefill(64, d, d)
    assert tuning.prefill_smem_bytes(cfg, chunk=64, block_k=d) <= shared_memory_budget(cc)
    assert cfg.block_v == (32 if cc == 120 else 64)
