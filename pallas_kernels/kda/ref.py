"""Pure-JAX oracles for KDA (Kimi Delta Attention), equal to Hugging Face's PyTorch functions.

GLM-5.3-Flash (``glm5_next``) interleaves KDA layers with DSA layers. A KDA layer runs the q / k / v
projections through a depthwise causal conv (:func:`causal_conv1d`, :func:`causal_conv1d_update`), then a
delta rule whose state decays per key channel (:func:`recurrent`, :func:`chunked`). These functions mirror
HF transformers 5.23's ``causal_conv1d_fn`` / ``causal_conv1d_update`` and
``recurrent_kimi_delta_attention`` / ``chunk_kimi_delta_attention`` op for op (the torch fallbacks, used
when neither ``fla`` nor ``causal-conv1d`` is installed), so a kernel can be checked against them and they
against the committed HF fixture (tests/reference/make_kda_reference.py).

Shape letters: T tokens, H heads, K key dim, V value dim, C conv channels, W conv width, B sequences.

Conventions, as HF's layer calls the functions:

* ``g`` is the log of the per-step, per-key-channel decay (HF's ``Glm5NextTextForgetGate`` output,
  ``linear_lower_bound * sigmoid(...)`` in (lower_bound, 0)); the KDA functions exponentiate it.
* q and k are L2-normalized *inside* the functions (HF's layer passes ``use_qk_l2norm_in_kernel=True``),
  after the cast to float32, with the epsilon inside the square root (:func:`l2norm`); then q is scaled.
* The state is ``[H, K, V]`` float32 (HF's ``[B, H, K, V]`` for one sequence): o_t = q_t^T S_t.
* Everything runs in float32 whatever the inputs' dtype; the output is cast back to q's dtype, the final
  state stays float32 (HF keeps it so, as rounding errors accumulate in it over the sequence).
* Matmuls use ``Precision.HIGHEST`` so that the oracle stays float32 on GPUs (no TF32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_L2NORM_EPS = 1e-6  # HF's kernels call l2norm(x, eps=1e-6)
_ACTIVATIONS = {None: lambda x: x, "silu": jax.nn.silu, "swish": jax.nn.silu}


def l2norm(x: jax.Array, eps: float = _L2NORM_EPS) -> jax.Array:
    """x [..., D] -> x / sqrt(sum(x^2) + eps) over the last axis, in x's dtype.

    HF's ``l2norm`` (matching FLA's Triton kernel): the epsilon is added under the square root, not
    clamped as ``F.normalize`` does, and the division is a true division (not a multiply by rsqrt)."""
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, state, scale, use_qk_l2norm):
    """HF's common prologue: float32 casts, in-kernel L2 norm, default scale 1/sqrt(K), zero state."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    if q.shape != k.shape or g.shape != k.shape or v.shape[:2] != (t, h) or beta.shape != (t, h):
        raise ValueError(
            f"KDA wants q, k, g [T,H,K], v [T,H,V], beta [T,H]; got q {q.shape} k {k.shape} v {v.shape} "
            f"g {g.shape} beta {beta.shape}"
        )
    if state is not None and state.shape != (h, dk, dv):
        raise ValueError(f"KDA state must be [H,K,V] = {(h, dk, dv)}, got {state.shape}")
    q, k, v, g, beta = (x.astype(_F32) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # HF: scale = 1 / (K ** 0.5), a Python float rounded to float32 when it multiplies q.
    scale = 1 / (dk**0.5) if scale is None else scale
    state = jnp.zeros((h, dk, dv), _F32) if state is None else state.astype(_F32)
    return q, k, v, g, beta, state, scale


def recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """One sequence, token by token: q, k, g [T,H,K], v [T,H,V], beta [T,H], state [H,K,V] | None
    -> (o [T,H,V] in q's dtype, final state [H,K,V] float32).

    HF's ``recurrent_kimi_delta_attention`` (its decode path, T = 1). Per token t, per head:

        S = S * exp(g_t)[:, None]                  decay each key channel (g is log-space)
        delta = (v_t - k_t^T S) * beta_t           the delta rule's correction
        S = S + k_t delta^T
        o_t = (scale * q_t)^T S                    read after the write: o_t sees token t

    ``scale`` defaults to HF's 1/sqrt(K) (HF has no such argument). ``use_qk_l2norm`` is HF's
    ``use_qk_l2norm_in_kernel``: HF's function defaults it to False, its only caller (the layer) passes
    True, hence the default here. A missing state is zeros; T = 0 returns an empty o and the state."""
    out_dtype = q.dtype
    q, k, v, g, beta, state, scale = _prepare(q, k, v, g, beta, state, scale, use_qk_l2norm)
    q = q * scale

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None]
        kv_mem = jnp.sum(s * k_t[..., None], axis=-2)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        return s, jnp.sum(s * q_t[..., None], axis=-2)

    state, o = jax.lax.scan(step, state, (q, k, v, g, beta))
    return o.astype(out_dtype), state


def segments(seq_ids: jax.Array, num_seqs: int) -> tuple[jax.Array, jax.Array]:
    """(first token, token count) of each of ``num_seqs`` sequences in a packed step whose tokens carry
    ``seq_ids [T]`` (-1: padding), each sequence's tokens contiguous and in order (0, 0 where none)."""
    t = seq_ids.shape[0]
    ids = jnp.where(seq_ids >= 0, seq_ids, num_seqs)  # padding: out of range, dropped
    count = jax.ops.segment_sum(jnp.ones((t,), jnp.int32), ids, num_segments=num_seqs)
    first = jax.ops.segment_min(jnp.arange(t, dtype=jnp.int32), ids, num_segments=num_seqs)
    return jnp.where(count > 0, first, 0), count


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
) -> tuple[jax.Array, jax.Array]:
    """:func:`recurrent` over a packed step of several sequences, their states kept in rows of a buffer.

    q, k, g [T,H,K], v [T,H,V], beta [T,H]: the step's tokens; ``seq_ids [T]`` their sequence (-1:
    padding), each sequence's tokens contiguous and in order (how the engine packs a step). ``state
    [R,H,K,V]`` float32 holds sequence s's state in row ``rows[s]`` (``rows [S]``); ``fresh [S]`` (bool):
    sequence s starts from a zero state (its tokens begin at position 0), else from its row. -> (o [T,H,V]
    in q's dtype, 0 for padding; the state buffer with every sequence's row advanced past its tokens,
    other rows as they were). Token by token, each reading and writing its sequence's row."""
    out_dtype = q.dtype
    q, k, v, g, beta = (x.astype(_F32) for x in (q, k, v, g, beta))
    q, k = l2norm(q) * (1 / (k.shape[-1] ** 0.5)), l2norm(k)
    first, _ = segments(seq_ids, rows.shape[0])
    live = seq_ids >= 0
    seq = jnp.where(live, seq_ids, 0)
    reset = live & (jnp.arange(seq_ids.shape[0]) == first[seq]) & fresh[seq]

    def step(buf, xs):
        q_t, k_t, v_t, g_t, b_t, s_t, live_t, reset_t = xs
        r = rows[s_t]
        old = buf[r]
        s = jnp.where(reset_t, 0.0, old) * jnp.exp(g_t)[..., None]
        delta = (v_t - jnp.sum(s * k_t[..., None], axis=-2)) * b_t[..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        o = jnp.where(live_t, jnp.sum(s * q_t[..., None], axis=-2), 0.0)
        return buf.at[r].set(jnp.where(live_t, s, old)), o

    state, o = jax.lax.scan(step, state.astype(_F32), (q, k, v, g, beta, seq, live, reset))
    return o.astype(out_dtype), state


def chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array | None = None,
    *,
    chunk: int = 64,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """One sequence, chunk by chunk: same arguments and result as :func:`recurrent` (plus ``chunk``).

    HF's ``chunk_kimi_delta_attention`` (its prefill path, chunk 64): T is zero-padded at the end to a
    multiple of ``chunk`` (padded tokens have k = 0 and beta = 0 so they do not touch the state, and g = 0
    so the last chunk's total decay is the last real token's), q is scaled after the padding. Within a
    chunk, with G the cumulative sum of g over the chunk's tokens:

        A[i,j] = -sum_c (beta_i k_i)[c] k_j[c] exp(G_i - G_j)[c]   for j < i
        M = (I - A)^-1 by forward substitution (HF's row loop)  ->  U = M (beta v), W = M (beta k exp(G))
        o = (q exp(G)) S + tril(q k^T exp(G_i - G_j)) (U - W S)
        S' = S exp(G_last) + (k exp(G_last - G))^T (U - W S)

    HF builds the decay tensor [H, n, chunk, chunk, K] for all n chunks up front; here each chunk builds
    its own inside the scan (the same elements, one chunk's memory). G is a float32 cumsum (torch on a GPU
    accumulates in float32 too); torch's CPU cumsum, which made the fixture, accumulates in double: with
    G down to -300 the two differ by ulps of 3e-5, yet the fixture's chunked outputs match to <= 5e-7
    relative either way (a large |G| comes with a vanishing decay factor). Differs from :func:`recurrent`
    by float32 rounding only."""
    out_dtype = q.dtype
    q, k, v, g, beta, state, scale = _prepare(q, k, v, g, beta, state, scale, use_qk_l2norm)
    t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk - t % chunk) % chunk
    n = (t + pad) // chunk

    def chunks(x):  # [T, H, ...] -> [n, H, chunk, ...], zero padded at the end
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return jnp.moveaxis(x.reshape(n, chunk, *x.shape[1:]), 1, 2)

    q = chunks(q) * scale
    k, v, g, beta = chunks(k), chunks(v), chunks(g), chunks(beta)
    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]

    upper = jnp.triu(jnp.ones((chunk, chunk), bool), k=0)  # j >= i
    strict = jnp.triu(jnp.ones((chunk, chunk), bool), k=1)  # j > i
    eye = jnp.eye(chunk, dtype=_F32)

    def substitute(i, a):
        """Row i of (I - A)^-1 - I from the rows above it (HF's loop; j >= i adds exact zeros)."""
        row = a[:, i, :]
        return a.at[:, i, :].set(row + jnp.sum(row[..., None] * a, axis=-2))

    def step(s, xs):
        q_i, k_i, v_beta_i, k_beta_i, g_i = xs  # [H, chunk, K or V]
        g_i = jnp.cumsum(g_i, axis=-2)
        decay = jnp.exp(jnp.where(strict[..., None], -jnp.inf, g_i[:, :, None, :] - g_i[:, None, :, :]))
        a = -jnp.sum(k_beta_i[:, :, None, :] * k_i[:, None, :, :] * decay, axis=-1)
        a = jax.lax.fori_loop(1, chunk, substitute, jnp.where(upper, 0.0, a)) + eye
        u = jnp.matmul(a, v_beta_i, precision=_HIGHEST)
        w = jnp.matmul(a, k_beta_i * jnp.exp(g_i), precision=_HIGHEST)  # HF's k_cumdecay

        attn_inter = jnp.matmul(q_i * jnp.exp(g_i), s, precision=_HIGHEST)
        attn_intra = jnp.sum(q_i[:, :, None, :] * k_i[:, None, :, :] * decay, axis=-1)
        attn_intra = jnp.where(strict, 0.0, attn_intra)
        v_new = u - jnp.matmul(w, s, precision=_HIGHEST)
        o = attn_inter + jnp.matmul(attn_intra, v_new, precision=_HIGHEST)
        g_last = g_i[:, -1:, :]
        kd = k_i * jnp.exp(g_last - g_i)
        s = s * jnp.exp(g_last)[:, 0, :, None] + jnp.matmul(kd.swapaxes(-1, -2), v_new, precision=_HIGHEST)
        return s, o

    state, o = jax.lax.scan(step, state, (q, k, v_beta, k_beta, g))
    o = jnp.moveaxis(o, 2, 1).reshape(n * chunk, h, dv)[:t]
    return o.astype(out_dtype), state


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state: jax.Array | None = None,
    *,
    activation: str | None,
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv of one sequence: x [T,C], weight [C,W], bias [C] | None, state [W-1,C] | None
    -> (y [T,C] in x's dtype, new state [W-1,C]).

    y_t[c] = act(bias[c] + sum_j weight[c,j] x_{t-W+1+j}[c]), the inputs before x taken from ``state``
    (zeros when None): HF's layer concatenates its conv cache before x and calls ``causal_conv1d_fn``
    (left padding W-1, conv in the weight's dtype, activation = config.hidden_act, "silu"), keeping the
    output's last T columns. Layout differs from HF's: tokens are rows here (HF's [B, C, T] transposed),
    ``weight`` is HF's ``conv1d.weight.squeeze(1)`` as is. The state holds the last W-1 inputs (not
    activated): HF's cache keeps W columns but the oldest never reaches an output (the output for token
    t reads inputs t-W+1..t), so W-1 rows carry everything. ``activation`` is None, "silu" or "swish".
    T = 0 returns an empty y and the state."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} not in {sorted(map(str, _ACTIVATIONS))}")
    c, width = weight.shape
    t = x.shape[0]
    if state is None:
        state = jnp.zeros((width - 1, c), x.dtype)
    if x.shape[1:] != (c,) or state.shape != (width - 1, c):
        raise ValueError(
            f"causal_conv1d wants x [T,{c}], state [{width - 1},{c}]; got {x.shape}, {state.shape}"
        )
    xp = jnp.concatenate([state.astype(x.dtype), x])  # [W-1+T, C]
    xw = xp.astype(weight.dtype)
    y = sum(xw[j : j + t] * weight[:, j] for j in range(width))
    if bias is not None:
        y = y + bias
    y = _ACTIVATIONS[activation](y)
    return y.astype(x.dtype), xp[t:]


def causal_conv1d_update(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state: jax.Array,
    *,
    activation: str | None,
) -> tuple[jax.Array, jax.Array]:
    """One decode token per sequence: x [B,C], state [B,W-1,C] -> (y [B,C], new state [B,W-1,C]).

    HF's ``causal_conv1d_update`` (which shifts the cache in place; here the new state is returned):
    the same arithmetic as :func:`causal_conv1d` with T = 1, one row per sequence."""
    conv = lambda x_b, s_b: causal_conv1d(x_b[None], weight, bias, s_b, activation=activation)
    y, state = jax.vmap(conv)(x, state)
    return y[:, 0], state
