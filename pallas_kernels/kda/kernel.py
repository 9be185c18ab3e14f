"""Pallas-Triton kernels for KDA (Kimi Delta Attention): decode step and chunked prefill.

Both compute :mod:`pallas_kernels.kda.ref`'s math (HF's layer: q and k L2-normalized inside, eps under the
square root, q scaled by 1/sqrt(K), ``g`` the per-channel log decay, float32 state ``[H, K, V]``), in
float32 whatever the input dtype; the output is cast to q's dtype, the state stays float32.

**Decode** (:func:`recurrent_step`): one token for each of B sequences. Grid ``(B, H, V / block_v)``; a
program loads its row's q, k, g (whole K rows: the L2 norms need them; K <= 256), v's tile and beta, and its
``[K, block_v]`` float32 state tile, then runs the reference step: decay, ``delta = (v - k^T S) beta``,
``S += k delta^T``, ``o = (scale q)^T S``. No dots: the two matrix-vector products are reductions over K.
The state is aliased in to out (``input_output_aliases``), so a caller that donates it updates it in place
and nothing copies the whole state. Rows whose ``valid`` entry is false (batch padding) store o = 0 and
leave their state untouched.

**Prefill** (:func:`chunked`): one sequence. Grid ``(H, V / block_v)``; a program keeps its ``[K, block_v]``
float32 state tile in registers and walks the chunks in order (no intermediate goes to memory). Per chunk
of C tokens, with G the cumulative sum of g over the chunk:

1. the decayed Gram matrices ``N[i,j] = -(beta_i k_i) . k_j exp(G_i - G_j)`` (j < i) and
   ``P[i,j] = q_i . k_j exp(G_i - G_j)`` (j <= i). The decay is per channel, so they are no plain matmul.
   Off the 16 x 16 diagonal blocks they are dots of factors that are each <= 1 (row block r against the
   earlier columns, both decays taken relative to the first row of block r: FLA's sub-chunk trick); the
   diagonal blocks are exact elementwise sums, one column at a time. No exponent is ever positive (g <= 0),
   so nothing overflows whatever the decay.
2. ``M = (I - N)^-1``: each diagonal block by HF's row substitution, then the block-triangular rest as
   ``M = (I + X)(I + X^2)... D`` with ``D`` the inverted diagonal blocks and ``X = D N_off`` (nilpotent).
3. the WY form ``U = M (beta v)``, ``W = M (beta k exp(G))`` and the ref's chunk update:
   ``V' = U - W S``, ``o = (q exp(G)) S + P V'``, ``S = S exp(G_last) + (k exp(G_last - G))^T V'``.

The chunk's dots run as TF32x3 on the GPU (``tuning.KdaConfig.dot``; each float32 operand split into two
TF32 halves, three tensor-core products, float32 accuracy), or as IEEE float32. The CPU interpreter has no
TF32, so interpret mode emulates TF32x3 (:func:`_dot`) and the tests see the GPU's rounding, up to the
MMA's summation order. Design, precision and what is not measured yet: docs/kernels.md §8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton, tile_pad
from pallas_kernels.kda import tuning
from pallas_kernels.kda.ref import l2norm, segments

_F32 = jnp.float32
_SUB = tuning.SUB
_MAX_K = 256  # a program holds whole K rows (the L2 norm) and a [K, block_v] state tile in registers


def _check(q, k, v, g, beta, lead: tuple[int, ...], what: str) -> tuple[int, int, int]:
    """(H, K, V) of KDA operands whose leading axes are ``lead``; raises on any other shape."""
    h, dk = k.shape[len(lead) :]
    dv = v.shape[-1]
    if q.shape != k.shape or g.shape != k.shape or v.shape != (*lead, h, dv) or beta.shape != (*lead, h):
        raise ValueError(
            f"{what}: q, k, g {[*lead, 'H', 'K']}, v {[*lead, 'H', 'V']}, beta {[*lead, 'H']}; "
            f"got q {q.shape} k {k.shape} v {v.shape} g {g.shape} beta {beta.shape}"
        )
    if dk > _MAX_K:
        raise ValueError(f"{what}: K = {dk} > {_MAX_K} does not fit one program's registers")
    return h, dk, dv


# ---------------------------------------------------------------------------------------------
# decode


def _recurrent_kernel(
    first_ref, count_ref, row_ref, fresh_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_in_ref,
    o_ref, s_out_ref, *, n_heads, dk, dv, block_k, block_v,
):  # fmt: skip
    seq, h = pl.program_id(0), pl.program_id(1)
    ks = jnp.arange(block_k, dtype=jnp.int32)
    vs = pl.program_id(2) * block_v + jnp.arange(block_v, dtype=jnp.int32)
    k_ok, v_ok = ks < dk, vs < dv
    first, count = pltriton.load(first_ref.at[seq]), pltriton.load(count_ref.at[seq])
    s_rows = (pltriton.load(row_ref.at[seq]) * n_heads + h) * dk + ks
    s_mask = k_ok[:, None] & v_ok[None, :] & (count > 0)
    s = pltriton.load(s_ref.at[s_rows[:, None], vs[None, :]], mask=s_mask, other=0.0)
    s = jnp.where(pltriton.load(fresh_ref.at[seq]) != 0, 0.0, s)

    def token(i, s):
        row = (first + i) * n_heads + h
        load = lambda ref, cols, mask: pltriton.load(ref.at[row, cols], mask=mask, other=0.0).astype(_F32)  # noqa: E731
        q = l2norm(load(q_ref, ks, k_ok)) * (1 / dk**0.5)
        k = l2norm(load(k_ref, ks, k_ok))
        s = s * jnp.exp(load(g_ref, ks, k_ok))[:, None]
        delta = (load(v_ref, vs, v_ok) - jnp.sum(s * k[:, None], axis=0)) * pltriton.load(beta_ref.at[row])
        s = s + k[:, None] * delta.astype(_F32)[None, :]
        pltriton.store(o_ref.at[row, vs], jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype), mask=v_ok)
        return s

    s = lax.fori_loop(0, count, token, s)
    pltriton.store(s_out_ref.at[s_rows[:, None], vs[None, :]], s, mask=s_mask)


def recurrent_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    seq_ids: jax.Array,
    rows: jax.Array,
    fresh: jax.Array,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.kda.ref.recurrent_packed`: a packed step's tokens (q, k, g [T,H,K],
    v [T,H,V], beta [T,H], ``seq_ids [T]``, each sequence's tokens contiguous and in order) advancing
    their sequences' float32 states, rows ``rows [S]`` of ``state [R,H,K,V]`` (``fresh [S]``: start from
    zeros) -> (o [T,H,V] in q's dtype, 0 for padding; the state buffer).

    Grid ``(S, H, V / block_v)``: a program walks its sequence's tokens in order with its ``[K, block_v]``
    state tile in registers, so a decode step (one token a sequence) reads and writes each state once and
    a prefill chunk keeps it on chip throughout. The buffer is aliased in to out: a caller that donates
    it (the engine's cache) updates only the rows it advances, in place."""
    t = q.shape[0]
    h, dk, dv = _check(q, k, v, g, beta, (t,), "recurrent_packed")
    r, s = state.shape[0], rows.shape[0]
    if state.shape != (r, h, dk, dv) or state.dtype != _F32:
        raise ValueError(
            f"recurrent_packed: state must be float32 [R,{h},{dk},{dv}], got {state.dtype} {state.shape}"
        )
    if seq_ids.shape != (t,) or fresh.shape != (s,):
        raise ValueError(
            f"recurrent_packed: seq_ids [{t}], rows and fresh [S]; "
            f"got {seq_ids.shape}, {rows.shape}, {fresh.shape}"
        )
    o = jnp.zeros((t * h, dv), q.dtype)
    if t * h * s == 0:
        return o.reshape(t, h, dv), state
    first, count = segments(seq_ids, s)
    cfg = tuning.choose_decode(dv)
    kernel = functools.partial(
        _recurrent_kernel, n_heads=h, dk=dk, dv=dv, block_k=tile_pad(dk), block_v=cfg.block_v
    )
    o, state = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(o.shape, o.dtype), jax.ShapeDtypeStruct((r * h * dk, dv), _F32)),
        grid=(s, h, pl.cdiv(dv, cfg.block_v)),
        input_output_aliases={10: 0, 9: 1},
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="kda_recurrent",
    )(
        first,
        count,
        rows.astype(jnp.int32),
        fresh.astype(jnp.int32),
        q.reshape(t * h, dk),
        k.reshape(t * h, dk),
        v.reshape(t * h, dv),
        g.reshape(t * h, dk),
        beta.reshape(t * h),
        state.reshape(r * h * dk, dv),
        o,
    )
    return o.reshape(t, h, dv), state.reshape(r, h, dk, dv)


def recurrent_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    valid: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One decode token for each of B sequences: q, k, g [B,H,K], v [B,H,V], beta [B,H], state [B,H,K,V]
    float32 -> (o [B,H,V] in q's dtype, new state [B,H,K,V] float32): :func:`recurrent_packed` with one
    token a sequence. ``valid`` [B] (bool) marks the rows that hold a sequence; the others (batch padding)
    get o = 0 and their state back unchanged."""
    b = q.shape[0]
    if valid is not None and valid.shape != (b,):
        raise ValueError(f"recurrent_step: valid must be [{b}], got {valid.shape}")
    ids = jnp.arange(b, dtype=jnp.int32)
    seq_ids = ids if valid is None else jnp.where(valid, ids, -1)
    fresh = jnp.zeros((b,), bool)
    return recurrent_packed(
        q, k, v, g, beta, state, seq_ids=seq_ids, rows=ids, fresh=fresh, interpret=interpret
    )


# ---------------------------------------------------------------------------------------------
# prefill

_TF32_KEEP = 0xFFFFE000  # sign, exponent and the 10 mantissa bits TF32 keeps
_TF32_HALF = 0x1000  # half a TF32 ulp, in float32 mantissa bits


def _tf32(x: jax.Array, *, rounded: bool) -> jax.Array:
    """``x`` cut to TF32: rounded to nearest, ties away (``cvt.rna.tf32.f32``, how Triton takes the high
    half), or truncated (what the tensor core does with the low bits of a float32 operand)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    if rounded:
        bits = bits + jnp.uint32(_TF32_HALF)
    return lax.bitcast_convert_type(bits & jnp.uint32(_TF32_KEEP), _F32)


def _dot(a: jax.Array, b: jax.Array, mode: str, contract=((1,), (0,))) -> jax.Array:
    """A float32 dot of the prefill's chunk step: ``mode`` "ieee" (float32 products), "tf32x3" (the GPU's
    three TF32 tensor-core products) or "tf32x3_emulated" (interpret mode: Triton's F32DotTC split, with
    the high halves rounded, the low halves truncated by the MMA, the low x low product dropped)."""
    dims = (contract, ((), ()))

    def dot(x, y, precision):
        return lax.dot_general(x, y, dims, precision=precision, preferred_element_type=_F32)

    if mode == "tf32x3":
        return dot(a, b, lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    if mode == "ieee":
        return dot(a, b, lax.Precision.HIGHEST)
    a_hi, b_hi = _tf32(a, rounded=True), _tf32(b, rounded=True)
    a_lo, b_lo = _tf32(a - a_hi, rounded=False), _tf32(b - b_hi, rounded=False)
    small = dot(a_lo, b_hi, lax.Precision.HIGHEST) + dot(a_hi, b_lo, lax.Precision.HIGHEST)
    return dot(a_hi, b_hi, lax.Precision.HIGHEST) + small


def _dot_nt(a, b, mode):  # a @ b^T
    return _dot(a, b, mode, ((1,), (1,)))


def _dot_tn(a, b, mode):  # a^T @ b
    return _dot(a, b, mode, ((0,), (0,)))


def _blocks(x: jax.Array) -> jax.Array:
    """[C, K] -> [C / 16, 16, K]: the chunk's rows by sub-chunk."""
    return x.reshape(x.shape[0] // _SUB, _SUB, x.shape[1])


def _block_diag(x3: jax.Array) -> jax.Array:
    """[R, 16, 16] -> the [16 R, 16 R] block-diagonal matrix of those blocks."""
    r = x3.shape[0]
    ids = jnp.arange(r, dtype=jnp.int32)
    same = ids[:, None, None, None] == ids[None, None, :, None]
    return jnp.where(same, x3[:, :, None, :], 0.0).reshape(r * _SUB, r * _SUB)


def _diag_blocks(q, k, kb, g_cum):
    """The diagonal 16 x 16 blocks of N (strictly lower) and P (lower), [R, 16, 16] each, as exact
    per-channel sums: column j of every block at once, ``exp(G_i - G_j)`` only for i >= j (<= 1)."""
    q3, k3, kb3, g3 = _blocks(q), _blocks(k), _blocks(kb), _blocks(g_cum)
    li = jnp.arange(_SUB, dtype=jnp.int32)
    rows, cols = li[None, :, None], li[None, None, :]

    def column(j, carry):
        n3, p3 = carry

        def pick(x3):  # row j of every block, [R, K]
            return jnp.sum(jnp.where(rows == j, x3, 0.0), axis=1)

        decay = jnp.exp(jnp.where(rows >= j, g3 - pick(g3)[:, None, :], -jnp.inf))
        kj = pick(k3)[:, None, :] * decay
        n_col = jnp.where(li[None, :] > j, -jnp.sum(kb3 * kj, axis=2), 0.0)
        p_col = jnp.sum(q3 * kj, axis=2)
        return jnp.where(cols == j, n_col[:, :, None], n3), jnp.where(cols == j, p_col[:, :, None], p3)

    zeros = jnp.zeros((q3.shape[0], _SUB, _SUB), _F32)
    return lax.fori_loop(0, _SUB, column, (zeros, zeros))


def _off_diag_blocks(q, k, kb, g_cum, mode):
    """N and P below the diagonal blocks, [C, C] each: row block r against columns < 16 r, as dots of
    ``x_i exp(G_i - G_n)`` and ``k_j exp(G_n - G_j)`` with n = 16 r, the block's first row (both <= 1)."""
    c = q.shape[0]
    ii = jnp.arange(c, dtype=jnp.int32)
    blk_ids = jnp.arange(c // _SUB, dtype=jnp.int32)[:, None, None]
    first = (jnp.arange(_SUB, dtype=jnp.int32) == 0)[:, None]
    q3, kb3, g3 = _blocks(q), _blocks(kb), _blocks(g_cum)

    def row_block(r, carry):
        n_off, p_off = carry

        def block(x3):  # row block r, [16, K]
            return jnp.sum(jnp.where(blk_ids == r, x3, 0.0), axis=0)

        def place(x):  # [16, C] as rows 16 r ... 16 r + 15 of a [C, C] matrix
            return jnp.where(blk_ids == r, x[None], 0.0).reshape(c, c)

        g_r = block(g3)
        g_n = jnp.sum(jnp.where(first, g_r, 0.0), axis=0)[None, :]
        row_decay = jnp.exp(g_r - g_n)
        k_col = k * jnp.exp(jnp.where((ii < r * _SUB)[:, None], g_n - g_cum, -jnp.inf))
        n_off = n_off - place(_dot_nt(block(kb3) * row_decay, k_col, mode))
        return n_off, p_off + place(_dot_nt(block(q3) * row_decay, k_col, mode))

    zeros = jnp.zeros((c, c), _F32)
    return lax.fori_loop(1, c // _SUB, row_block, (zeros, zeros))


def _invert_diag_blocks(n3: jax.Array) -> jax.Array:
    """(I - N_b)^-1 of each strictly lower 16 x 16 block: HF's row substitution, all blocks at once."""
    li = jnp.arange(_SUB, dtype=jnp.int32)
    rows = li[None, :, None]

    def substitute(i, x3):
        row = jnp.sum(jnp.where(rows == i, x3, 0.0), axis=1)  # [R, 16]
        return jnp.where(rows == i, (row + jnp.sum(row[:, :, None] * x3, axis=1))[:, None, :], x3)

    return lax.fori_loop(1, _SUB, substitute, n3) + (rows == li[None, None, :]).astype(_F32)


def _unit_lower_inverse(n3, n_off, mode):
    """(I - N)^-1 for N = blockdiag(n3) + n_off (strictly lower): ``(I - X)^-1 D`` with D the inverted
    diagonal blocks and X = D n_off, strictly block-lower so nilpotent of order R (the block count):
    ``(I - X)^-1 = (I + X)(I + X^2)(I + X^4)...``, one dot per factor and one per squaring."""
    d = _block_diag(_invert_diag_blocks(n3))
    m, power, reach = d, _dot(d, n_off, mode), 1
    while reach < n3.shape[0]:
        m = m + _dot(power, m, mode)
        reach *= 2
        if reach < n3.shape[0]:
            power = _dot(power, power, mode)
    return m


def _chunk_step(q, k, v, g_cum, beta, state, mode):
    """One chunk of the ref's :func:`pallas_kernels.kda.ref.chunked` on a [K, block_v] state tile:
    q (normalized, scaled), k (normalized), g_cum [C, K], v [C, block_v], beta [C] -> (o, new state)."""
    kb = k * beta[:, None]
    n3, p3 = _diag_blocks(q, k, kb, g_cum)
    n_off, p_off = _off_diag_blocks(q, k, kb, g_cum, mode)
    m = _unit_lower_inverse(n3, n_off, mode)
    decay = jnp.exp(g_cum)
    u = _dot(m, v * beta[:, None], mode)
    w = _dot(m, kb * decay, mode)
    v_new = u - _dot(w, state, mode)
    o = _dot(q * decay, state, mode) + _dot(p_off + _block_diag(p3), v_new, mode)
    last = (jnp.arange(q.shape[0], dtype=jnp.int32) == q.shape[0] - 1)[:, None]
    g_last = jnp.sum(jnp.where(last, g_cum, 0.0), axis=0)
    state = state * jnp.exp(g_last)[:, None] + _dot_tn(k * jnp.exp(g_last[None, :] - g_cum), v_new, mode)
    return o, state


def _prefill_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, t, dk, dv, chunk, block_k, block_v, mode
):
    h = pl.program_id(0)
    ii = jnp.arange(chunk, dtype=jnp.int32)
    ks = jnp.arange(block_k, dtype=jnp.int32)
    vs = pl.program_id(1) * block_v + jnp.arange(block_v, dtype=jnp.int32)
    k_ok, v_ok = ks < dk, vs < dv
    k_cols, v_cols = (h * dk + ks)[None, :], (h * dv + vs)[None, :]
    s_tile = ((h * dk + ks)[:, None], vs[None, :])
    s_mask = k_ok[:, None] & v_ok[None, :]

    def step(i, state):
        rows = i * chunk + ii
        row_ok = rows < t  # the ragged last chunk: q, k, g, v, beta = 0 (the ref's zero padding)
        mk, mv = row_ok[:, None] & k_ok[None, :], row_ok[:, None] & v_ok[None, :]

        def rows_of(ref, cols, mask):
            return pltriton.load(ref.at[rows[:, None], cols], mask=mask, other=0.0).astype(_F32)

        q = l2norm(rows_of(q_ref, k_cols, mk)) * (1 / dk**0.5)
        k = l2norm(rows_of(k_ref, k_cols, mk))
        g_cum = jnp.cumsum(rows_of(g_ref, k_cols, mk), axis=0)
        beta = pltriton.load(beta_ref.at[rows, h], mask=row_ok, other=0.0).astype(_F32)
        o, state = _chunk_step(q, k, rows_of(v_ref, v_cols, mv), g_cum, beta, state, mode)
        pltriton.store(o_ref.at[rows[:, None], v_cols], o.astype(o_ref.dtype), mask=mv)
        return state

    state = pltriton.load(s_ref.at[s_tile], mask=s_mask, other=0.0)
    state = lax.fori_loop(0, pl.cdiv(t, chunk), step, state)
    pltriton.store(s_out_ref.at[s_tile], state, mask=s_mask)


def chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array | None = None,
    *,
    chunk: int = 64,
    interpret: bool = False,
    config: tuning.KdaConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Prefill of one sequence: q, k, g [T,H,K], v [T,H,V], beta [T,H], state [H,K,V] float32 | None
    -> (o [T,H,V] in q's dtype, final state [H,K,V] float32).

    :func:`pallas_kernels.kda.ref.chunked`'s math in ``chunk``-token steps (a power of two >= 16; the
    result does not depend on it beyond rounding). A missing state is zeros; the final state is written
    over ``state``'s buffer (aliased), in place when the caller donates it. ``config`` overrides
    :func:`pallas_kernels.kda.tuning.choose_prefill` (the tests' IEEE dots)."""
    t = q.shape[0]
    h, dk, dv = _check(q, k, v, g, beta, (t,), "chunked")
    if chunk < _SUB or chunk & (chunk - 1):
        raise ValueError(f"chunked: chunk must be a power of two >= {_SUB}, got {chunk}")
    state = jnp.zeros((h, dk, dv), _F32) if state is None else state
    if state.shape != (h, dk, dv) or state.dtype != _F32:
        raise ValueError(f"chunked: state must be float32 {(h, dk, dv)}, got {state.dtype} {state.shape}")
    if t == 0 or h == 0:
        return jnp.zeros((t, h, dv), q.dtype), state
    block_k = tile_pad(dk)
    cfg = config or tuning.choose_prefill(chunk, dk, dv)
    mode = f"{cfg.dot}_emulated" if interpret and cfg.dot == "tf32x3" else cfg.dot
    kernel = functools.partial(
        _prefill_kernel, t=t, dk=dk, dv=dv, chunk=chunk, block_k=block_k, block_v=cfg.block_v, mode=mode
    )
    o, final = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((t, h * dv), q.dtype),
            jax.ShapeDtypeStruct((h * dk, dv), _F32),
        ),
        grid=(h, pl.cdiv(dv, cfg.block_v)),
        input_output_aliases={5: 1},
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="kda_chunked",
    )(
        q.reshape(t, h * dk),
        k.reshape(t, h * dk),
        v.reshape(t, h * dv),
        g.reshape(t, h * dk),
        beta,
        state.reshape(h * dk, dv),
    )
    return o.reshape(t, h, dv), final.reshape(h, dk, dv)
