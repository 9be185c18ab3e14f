"""Pallas-Triton kernels for DeepSeek-V4's hyper-connection sites (docs/models.md §3.2).

``hc_pre``, fused (``splits`` = 1): grid ``(token blocks,)``. A program owns ``block_t`` tokens and

1. streams their flattened streams ``x [block_t, n D]`` in ``block_k`` column tiles, accumulating
   the mixing logits as three dots against the matching rows of ``fn`` (pre, post and comb column
   ranges, each read with a column mask straight from the unpadded ``[n D, (2 + n) n]`` matrix, so
   every dot is at least 16 wide) and the sum of squares for the RMS;
2. applies the RMS, scale and base; ``pre`` and ``post`` are sigmoids, ``comb`` is reshaped to
   ``[block_t, n, n]`` and Sinkhorn-normalized in registers (row softmax, then alternating column
   and row sums);
3. collapses the streams ``sum_i pre_i x_i`` in ``block_d`` column tiles (a second, L2-warm read of
   the same rows).

That walks all ``n D`` = 16384 columns (128 steps) in one program per 16 tokens: at decode one
program does it all, a chain of dependent steps (H100: 240-315 us at T = 1-512 for 1.6-18 MB).
``splits`` > 1 splits the columns instead: a ``(token blocks, splits)`` grid of partial mixing
sums (added by one XLA fusion), then a ``(token blocks, column blocks)`` grid where every program
recomputes its tokens' weights and Sinkhorn from the sums (cheap) and collapses its ``block_d``
columns (H100: 32-148 us at T = 1-512; the fused kernel stays at T = 4096, see :mod:`.tuning`).

``hc_post``: grid ``(token blocks, column blocks)``, elementwise in D:
``x'_j = post_j out + sum_i comb_ij x_i``, one load of each input stream's tile per program.

Both run the whole math in float32 whatever the stream dtype (the decode mixing dots as TF32x3
products, float32-accurate: :func:`_dot_precision`). ``n`` must be a power of two with
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


def _dot_precision(t_blocks: int, interpret: bool):
    """The split mixing kernel's dots: at decode (one token block) three TF32 tensor-core products
    (each operand split into a high and a low TF32 part: float32 accuracy, bf16 streams exact),
    since Triton's IEEE float32 dot runs on the CUDA cores and took 66.8 us a launch there for a
    1.5 MB ``fn`` (H200, V4-Flash decode at one stream; 7.7 us with TF32x3,
    ``decode_anatomy-h200-v4flash-fp8-8l-s1{,-mhc}.md``). More token blocks keep IEEE float32 (T =
    128 / 512: 31.8 / 80.7 us a site, ``v4_kernels-h200-hc.md``): a probe with TF32x3 there, together
    with another change since dropped, was slower, and it has not been measured alone. The CPU
    interpreter, which has no TF32, keeps IEEE too."""
    if interpret or t_blocks > 1:
        return lax.Precision.HIGHEST
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _dot(a, b, precision=lax.Precision.HIGHEST):
    return lax.dot_general(
        a,
        b,
        dimension_numbers=(((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=precision,
    )


def _mix(
    x_ref,
    fn_ref,
    rows,
    row_ok,
    k_first,
    steps: int,
    *,
    n: int,
    d: int,
    bt: int,
    bk: int,
    precision=lax.Precision.HIGHEST,
):
    """Mixing logits (unscaled) and sum of squares of ``rows`` over ``steps`` column tiles of the
    flattened streams from column ``k_first``: ``(pre [bt, w], post [bt, w], comb [bt, n n], ss [bt])``
    with w = max(16, n) (columns past n are 0)."""
    width, k_total = max(_MIN_DOT, n), n * d
    cols = jnp.arange(width, dtype=jnp.int32)
    ccols = jnp.arange(n * n, dtype=jnp.int32)

    def step(i, carry):
        a_pre, a_post, a_comb, ss = carry
        ks = k_first + i * bk + jnp.arange(bk, dtype=jnp.int32)
        k_ok = ks < k_total
        xt = pltriton.load(
            x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        ).astype(jnp.float32)

        def weights(first: int, idx, real: int):
            view = fn_ref.at[ks[:, None], (first + idx)[None, :]]
            return pltriton.load(view, mask=k_ok[:, None] & (idx < real)[None, :], other=0.0)

        a_pre = a_pre + _dot(xt, weights(0, cols, n), precision)
        a_post = a_post + _dot(xt, weights(n, cols, n), precision)
        a_comb = a_comb + _dot(xt, weights(2 * n, ccols, n * n), precision)
        return a_pre, a_post, a_comb, ss + jnp.sum(xt * xt, axis=1)

    init = (
        jnp.zeros((bt, width), jnp.float32),
        jnp.zeros((bt, width), jnp.float32),
        jnp.zeros((bt, n * n), jnp.float32),
        jnp.zeros((bt,), jnp.float32),
    )
    return lax.fori_loop(0, steps, step, init)


def _site_weights(a_pre, a_post, a_comb, ss, base_ref, scale_ref, *, n, d, iters, hc_eps, norm_eps):
    """(pre [bt, w], post [bt, w], comb [bt, n, n]) from the mixing logits and the sum of squares."""
    bt, width = a_pre.shape
    cols = jnp.arange(width, dtype=jnp.int32)
    ccols = jnp.arange(n * n, dtype=jnp.int32)
    rs = lax.rsqrt(ss / (n * d) + norm_eps)[:, None]

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

    return pre, post, lax.fori_loop(0, iters - 1, sinkhorn_step, c)


def _store_weights(post_ref, comb_ref, post, c, rows, row_ok, n: int, extra_mask=True) -> None:
    cols = jnp.arange(post.shape[1], dtype=jnp.int32)
    ccols = jnp.arange(n * n, dtype=jnp.int32)
    ok = row_ok & extra_mask
    pltriton.store(post_ref.at[rows[:, None], cols[None, :]], post, mask=ok[:, None] & (cols < n)[None, :])
    pltriton.store(comb_ref.at[rows[:, None], ccols[None, :]], c.reshape(-1, n * n), mask=ok[:, None])


def _collapse(x_ref, out_ref, pre, rows, row_ok, d0, *, n: int, d: int, bd: int) -> None:
    """``out[rows, d0 : d0 + bd] = sum_i pre_i x_i`` over those columns."""
    cols = jnp.arange(pre.shape[1], dtype=jnp.int32)
    ds = d0 + jnp.arange(bd, dtype=jnp.int32)
    mask = row_ok[:, None] & (ds < d)[None, :]
    acc = jnp.zeros((pre.shape[0], bd), jnp.float32)
    for i in range(n):
        xi = pltriton.load(x_ref.at[rows[:, None], (i * d + ds)[None, :]], mask=mask, other=0.0)
        pre_i = jnp.sum(jnp.where(cols[None, :] == i, pre, 0.0), axis=1)
        acc = acc + pre_i[:, None] * xi.astype(jnp.float32)
    pltriton.store(out_ref.at[rows[:, None], ds[None, :]], acc.astype(out_ref.dtype), mask=mask)


def _pre_kernel(
    x_ref, fn_ref, base_ref, scale_ref, out_ref, post_ref, comb_ref, *, t, n, d, iters, hc_eps, norm_eps, cfg
):
    """Fused (``splits`` = 1): one program per token block walks every column, then the weights and
    the collapse."""
    bt, bk, bd = cfg.block_t, cfg.block_k, cfg.block_d
    rows = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    row_ok = rows < t
    mixed = _mix(x_ref, fn_ref, rows, row_ok, 0, pl.cdiv(n * d, bk), n=n, d=d, bt=bt, bk=bk)
    pre, post, c = _site_weights(
        *mixed, base_ref, scale_ref, n=n, d=d, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps
    )
    _store_weights(post_ref, comb_ref, post, c, rows, row_ok, n)

    def collapse_step(j, _):
        _collapse(x_ref, out_ref, pre, rows, row_ok, j * bd, n=n, d=d, bd=bd)
        return 0

    lax.fori_loop(0, pl.cdiv(d, bd), collapse_step, 0)


def _mix_split_kernel(x_ref, fn_ref, pre_ref, post_ref, comb_ref, ss_ref, *, t, n, d, steps, cfg, precision):
    """Program (token block, split): the mixing logits over the split's ``steps`` column tiles,
    stored as partial sums at rows ``split * t + token``."""
    bt, bk = cfg.block_t, cfg.block_k
    rows = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    row_ok = rows < t
    split = pl.program_id(1)
    a_pre, a_post, a_comb, ss = _mix(
        x_ref, fn_ref, rows, row_ok, split * steps * bk, steps, n=n, d=d, bt=bt, bk=bk, precision=precision
    )
    out = split * t + rows
    cols = jnp.arange(a_pre.shape[1], dtype=jnp.int32)
    ccols = jnp.arange(n * n, dtype=jnp.int32)
    pltriton.store(pre_ref.at[out[:, None], cols[None, :]], a_pre, mask=row_ok[:, None])
    pltriton.store(post_ref.at[out[:, None], cols[None, :]], a_post, mask=row_ok[:, None])
    pltriton.store(comb_ref.at[out[:, None], ccols[None, :]], a_comb, mask=row_ok[:, None])
    pltriton.store(ss_ref.at[out], ss, mask=row_ok)


def _finish_kernel(
    x_ref,
    a_pre_ref,
    a_post_ref,
    a_comb_ref,
    ss_ref,
    base_ref,
    scale_ref,
    out_ref,
    post_ref,
    comb_ref,
    *,
    t,
    n,
    d,
    iters,
    hc_eps,
    norm_eps,
    cfg,
):
    """Program (token block, column block): the weights from the summed logits (every column block
    recomputes them, a few hundred flops per token), post / comb stored by column block 0, and the
    collapse of its columns."""
    bt, bd = cfg.block_t, cfg.block_d
    rows = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    row_ok = rows < t
    cols = jnp.arange(max(_MIN_DOT, n), dtype=jnp.int32)
    ccols = jnp.arange(n * n, dtype=jnp.int32)

    def load(ref, c):
        return pltriton.load(ref.at[rows[:, None], c[None, :]], mask=row_ok[:, None], other=0.0)

    pre, post, c = _site_weights(
        load(a_pre_ref, cols),
        load(a_post_ref, cols),
        load(a_comb_ref, ccols),
        pltriton.load(ss_ref.at[rows], mask=row_ok, other=0.0),
        base_ref,
        scale_ref,
        n=n,
        d=d,
        iters=iters,
        hc_eps=hc_eps,
        norm_eps=norm_eps,
    )
    _store_weights(post_ref, comb_ref, post, c, rows, row_ok, n, extra_mask=pl.program_id(1) == 0)
    _collapse(x_ref, out_ref, pre, rows, row_ok, pl.program_id(1) * bd, n=n, d=d, bd=bd)


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
    x2, fn32 = x.reshape(t, n * d), fn.astype(jnp.float32)
    base32, scale32 = base.astype(jnp.float32), scale.astype(jnp.float32)
    out_shape = (
        jax.ShapeDtypeStruct((t, d), x.dtype),
        jax.ShapeDtypeStruct((t, n), jnp.float32),
        jax.ShapeDtypeStruct((t, n * n), jnp.float32),
    )
    kw = dict(t=t, n=n, d=d, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, cfg=cfg)
    params = compiler_params(cfg.num_warps, cfg.num_stages)
    t_blocks = pl.cdiv(t, cfg.block_t)
    if cfg.splits == 1:
        collapsed, post, comb = pl.pallas_call(
            functools.partial(_pre_kernel, **kw),
            out_shape=out_shape,
            grid=(t_blocks,),
            compiler_params=params,
            interpret=interpret,
            name="hc_pre",
        )(x2, fn32, base32, scale32)
        return collapsed, post, comb.reshape(t, n, n)
    # Split path: the mixing GEMM split over column ranges (partial sums added by one XLA fusion),
    # then the weights and the collapse over a (token block, column block) grid.
    steps = pl.cdiv(pl.cdiv(n * d, cfg.block_k), cfg.splits)
    splits = pl.cdiv(pl.cdiv(n * d, cfg.block_k), steps)
    width = max(_MIN_DOT, n)
    parts = pl.pallas_call(
        functools.partial(
            _mix_split_kernel,
            t=t,
            n=n,
            d=d,
            steps=steps,
            cfg=cfg,
            precision=_dot_precision(t_blocks, interpret),
        ),
        out_shape=(
            jax.ShapeDtypeStruct((splits * t, width), jnp.float32),
            jax.ShapeDtypeStruct((splits * t, width), jnp.float32),
            jax.ShapeDtypeStruct((splits * t, n * n), jnp.float32),
            jax.ShapeDtypeStruct((splits * t,), jnp.float32),
        ),
        grid=(t_blocks, splits),
        compiler_params=params,
        interpret=interpret,
        name="hc_pre_mix",
    )(x2, fn32)
    summed = [p.reshape(splits, t, *p.shape[1:]).sum(axis=0) for p in parts]
    collapsed, post, comb = pl.pallas_call(
        functools.partial(_finish_kernel, **kw),
        out_shape=out_shape,
        grid=(t_blocks, pl.cdiv(d, cfg.block_d)),
        compiler_params=params,
        interpret=interpret,
        name="hc_pre_finish",
    )(x2, *summed, base32, scale32)
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
