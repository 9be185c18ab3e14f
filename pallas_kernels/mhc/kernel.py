"""Pallas-Triton kernels for DeepSeek-V4's hyper-connection sites (models.md §3.2).

``hc_pre``: grid ``(token blocks,)``. A program owns ``block_t`` tokens and

1. streams their flattened streams ``x [block_t, n D]`` in ``block_k`` column tiles, accumulating
   the mixing logits as three dots against the matching rows of ``fn`` (pre, post and comb column
   ranges, each read with a column mask straight from the unpadded ``[n D, (2 + n) n]`` matrix, so
   every dot is at least 16 wide) and the sum of squares for the RMS;
2. applies the RMS, scale and base; ``pre`` and ``post`` are sigmoids, ``comb`` is reshaped to
   ``[block_t, n, n]`` and Sinkhorn-normalized in registers (row softmax, then alternating column
   and row sums);
3. collapses the streams ``sum_i pre_i x_i`` in ``block_d`` column tiles (a second, L2-warm read of
   the same rows).

``hc_post``: grid ``(token blocks, column blocks)``, elementwise in D:
``x'_j = post_j out + sum_i comb_ij x_i``, one load of each input stream's tile per program.

Both run the whole math in float32 whatever the stream dtype. ``n`` must be a power of two with
``n * n >= 16`` (V4 ships n = 4); other shapes fall back to the reference.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.mhc import ref, tuning

_MIN_DOT = 16


def _supported(n: int) -> bool:
    return n & (n - 1) == 0 and n * n >= _MIN_DOT


def _pre_kernel(
    x_ref, fn_ref, base_ref, scale_ref, out_ref, post_ref, comb_ref, *, t, n, d, iters, hc_eps, norm_eps, cfg
):
    bt, bk, bd = cfg.block_t, cfg.block_k, cfg.block_d
    width = max(_MIN_DOT, n)  # pre / post column tiles: n real columns, the rest masked to 0
    k_total = n * d
    rows = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    row_ok = rows < t
    cols = jnp.arange(width, dtype=jnp.int32)
    ccols = jnp.arange(n * n, dtype=jnp.int32)
    dot = functools.partial(
        lax.dot_general,
        dimension_numbers=(((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST,
    )

    def mix_step(i, carry):
        a_pre, a_post, a_comb, ss = carry
        ks = i * bk + jnp.arange(bk, dtype=jnp.int32)
        k_ok = ks < k_total
        xt = pltriton.load(
            x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        ).astype(jnp.float32)

        def weights(first: int, idx, real: int):
            view = fn_ref.at[ks[:, None], (first + idx)[None, :]]
            return pltriton.load(view, mask=k_ok[:, None] & (idx < real)[None, :], other=0.0)

        a_pre = a_pre + dot(xt, weights(0, cols, n))
        a_post = a_post + dot(xt, weights(n, cols, n))
        a_comb = a_comb + dot(xt, weights(2 * n, ccols, n * n))
        return a_pre, a_post, a_comb, ss + jnp.sum(xt * xt, axis=1)

    init = (
        jnp.zeros((bt, width), jnp.float32),
        jnp.zeros((bt, width), jnp.float32),
        jnp.zeros((bt, n * n), jnp.float32),
        jnp.zeros((bt,), jnp.float32),
    )
    a_pre, a_post, a_comb, ss = lax.fori_loop(0, pl.cdiv(k_total, bk), mix_step, init)
    rs = lax.rsqrt(ss / k_total + norm_eps)[:, None]

    def base(first: int, idx, real: int):
        return pltriton.load(base_ref.at[first + idx], mask=idx < real, other=0.0)[None, :]

    pre = jax.nn.sigmoid(a_pre * rs * scale_ref[0] + base(0, cols, n)) + hc_eps
    post = 2.0 * jax.nn.sigmoid(a_post * rs * scale_ref[1] + base(n, cols, n))
    logits = (a_comb * rs * scale_ref[2] + base(2 * n, ccols, n * n)).reshape(bt, n, n)
    e = jnp.exp(logits - jnp.max(logits, axis=2)[:, :, None])
    c = e / jnp.sum(e, axis=2)[:, :, None] + hc_eps
    c = c / (jnp.sum(c, axis=1)[:, None, :] + hc_eps)

    def sinkhorn_step(_, c):
        c = c / (jnp.sum(c, axis=2)[:, :, None] + hc_eps)
        return c / (jnp.sum(c, axis=1)[:, None, :] + hc_eps)

    c = lax.fori_loop(0, iters - 1, sinkhorn_step, c)
    pltriton.store(
        post_ref.at[rows[:, None], cols[None, :]], post, mask=row_ok[:, None] & (cols < n)[None, :]
    )
    pltriton.store(comb_ref.at[rows[:, None], ccols[None, :]], c.reshape(bt, n * n), mask=row_ok[:, None])

    def collapse_step(j, _):
        ds = j * bd + jnp.arange(bd, dtype=jnp.int32)
        mask = row_ok[:, None] & (ds < d)[None, :]
        acc = jnp.zeros((bt, bd), jnp.float32)
        for i in range(n):
            xi = pltriton.load(x_ref.at[rows[:, None], (i * d + ds)[None, :]], mask=mask, other=0.0)
            pre_i = jnp.sum(jnp.where(cols[None, :] == i, pre, 0.0), axis=1)
            acc = acc + pre_i[:, None] * xi.astype(jnp.float32)
        pltriton.store(out_ref.at[rows[:, None], ds[None, :]], acc.astype(out_ref.dtype), mask=mask)
        return 0

    lax.fori_loop(0, pl.cdiv(d, bd), collapse_step, 0)


def hc_pre(
    x: jax.Array,
    fn: jax.Array,
    base: jax.Array,
    scale: jax.Array,
    *,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    interpret: bool = False,
    config: tuning.MhcConfig | None = None,
):
    """See :func:`jaxdsa.ops.hc_pre`: x [T, n, D], fn [n D, (2 + n) n], base [(2 + n) n], scale [3]
    -> (collapsed [T, D] in x.dtype, post [T, n] f32, comb [T, n, n] f32)."""
    t, n, d = x.shape
    if fn.shape != (n * d, (2 + n) * n) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        raise ValueError(f"hc_pre: x {x.shape}, fn {fn.shape}, base {base.shape}, scale {scale.shape}")
    if not _supported(n):
        warnings.warn(f"hc_pre: {n} streams is not a power of two >= 4; running the reference", stacklevel=2)
        return ref.hc_pre(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    if t == 0:
        return jnp.zeros((0, d), x.dtype), jnp.zeros((0, n), jnp.float32), jnp.zeros((0, n, n), jnp.float32)
    cfg = config or tuning.choose(t, n, d)
    kernel = functools.partial(
        _pre_kernel, t=t, n=n, d=d, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, cfg=cfg
    )
    collapsed, post, comb = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((t, d), x.dtype),
            jax.ShapeDtypeStruct((t, n), jnp.float32),
            jax.ShapeDtypeStruct((t, n * n), jnp.float32),
        ),
        grid=(pl.cdiv(t, cfg.block_t),),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="hc_pre",
    )(x.reshape(t, n * d), fn.astype(jnp.float32), base.astype(jnp.float32), scale.astype(jnp.float32))
    return collapsed, post, comb.reshape(t, n, n)


def _post_kernel(x_ref, out_ref, post_ref, comb_ref, y_ref, *, t, n, d, cfg):
    bt, bd = cfg.block_t, cfg.block_d
    rows = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    ds = pl.program_id(1) * bd + jnp.arange(bd, dtype=jnp.int32)
    js = jnp.arange(n, dtype=jnp.int32)
    row_ok = rows < t
    mask = row_ok[:, None] & (ds < d)[None, :]
    f = pltriton.load(out_ref.at[rows[:, None], ds[None, :]], mask=mask, other=0.0).astype(jnp.float32)
    post = pltriton.load(post_ref.at[rows[:, None], js[None, :]], mask=row_ok[:, None], other=0.0)
    y = post[:, :, None] * f[:, None, :]
    for i in range(n):
        comb_i = pltriton.load(
            comb_ref.at[rows[:, None], (i * n + js)[None, :]], mask=row_ok[:, None], other=0.0
        )
        xi = pltriton.load(x_ref.at[rows[:, None], (i * d + ds)[None, :]], mask=mask, other=0.0)
        y = y + comb_i[:, :, None] * xi.astype(jnp.float32)[:, None, :]
    view = y_ref.at[rows[:, None, None], js[None, :, None] * d + ds[None, None, :]]
    full_mask = mask[:, None, :] & (js < n)[None, :, None]
    pltriton.store(view, y.astype(y_ref.dtype), mask=full_mask)


def hc_post(
    x: jax.Array,
    out: jax.Array,
    post: jax.Array,
    comb: jax.Array,
    *,
    interpret: bool = False,
    config: tuning.MhcConfig | None = None,
) -> jax.Array:
    """See :func:`jaxdsa.ops.hc_post`: x [T, n, D], out [T, D], post [T, n], comb [T, n, n] -> [T, n, D]."""
    t, n, d = x.shape
    if out.shape != (t, d) or post.shape != (t, n) or comb.shape != (t, n, n):
        raise ValueError(f"hc_post: x {x.shape}, out {out.shape}, post {post.shape}, comb {comb.shape}")
    if n & (n - 1):
        warnings.warn(f"hc_post: {n} streams is not a power of two; running the reference", stacklevel=2)
        return ref.hc_post(x, out, post, comb)
    if t == 0:
        return jnp.zeros_like(x)
    cfg = config or tuning.choose(t, n, d)
    y = pl.pallas_call(
        functools.partial(_post_kernel, t=t, n=n, d=d, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((t, n * d), x.dtype),
        grid=(pl.cdiv(t, cfg.block_t), pl.cdiv(d, cfg.block_d)),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="hc_post",
    )(x.reshape(t, n * d), out, post.astype(jnp.float32), comb.reshape(t, n * n).astype(jnp.float32))
    return y.reshape(t, n, d)
