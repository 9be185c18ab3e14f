"""Pallas-Triton kernel for the DeepSeek-V4 compressor's pooling (docs/models.md §3.4).

Grid ``(W,)``: one program per compressed entry. It walks the entry's slots ``block_s`` rows at a
time with an online softmax kept **per channel** (running max, denominator and weighted sum are
``[d]`` vectors in float32), so an HCA window of 128 rows never has to sit in registers at once:

- overlapping windows (CSA, ``c d = 2 d``): first the ``m`` rows of window ``w - 1``, channels
  ``[0, d)`` -- or, for ``w = 0``, the carried ``prev_kv`` / ``prev_score`` rows (two loads with
  complementary masks, so only one of them touches memory) -- then window ``w``'s rows, channels
  ``[d, 2 d)``;
- plain windows (HCA): window ``w``'s rows, all ``d`` channels.

Then ``pooled = acc / denom`` is RMS-normalized over its ``d`` channels, multiplied by the norm
weight and stored. Channel widths are padded to a power of two with masks (the tiny models' 16 / 32
and the real 128 / 512 are powers of two already); slot tiles are masked past ``m``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.compress_pool import tuning


def _pool_kernel(*refs, m: int, d: int, cd: int, overlap: bool, eps: float, cfg):
    if overlap:
        kv_ref, sc_ref, prev_kv_ref, prev_sc_ref, norm_ref, out_ref = refs
    else:
        kv_ref, sc_ref, norm_ref, out_ref = refs
    bs, dp = cfg.block_s, cfg.d_pad
    win = pl.program_id(0)
    chans = jnp.arange(dp, dtype=jnp.int32)
    chan_ok = chans < d
    slots0 = jnp.arange(bs, dtype=jnp.int32)

    def absorb(kv, sc, state):
        run_max, denom, acc = state
        new_max = jnp.maximum(run_max, jnp.max(sc, axis=0))
        ref_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # nothing seen yet: keep exp finite
        alpha = jnp.exp(run_max - ref_max)
        p = jnp.exp(sc - ref_max[None, :])
        return new_max, denom * alpha + jnp.sum(p, axis=0), acc * alpha + jnp.sum(p * kv, axis=0)

    def window_pass(state, first_row, first_chan, *, carried: bool):
        def step(j, state):
            slots = j * bs + slots0
            mask = (slots < m)[:, None] & chan_ok[None, :]
            rows = (first_row + slots)[:, None]
            cols = (first_chan + chans)[None, :]
            if not carried:
                kv = pltriton.load(kv_ref.at[rows, cols], mask=mask, other=0.0)
                sc = pltriton.load(sc_ref.at[rows, cols], mask=mask, other=-jnp.inf)
            else:  # window w - 1 from this call's rows, or the carried previous window when w == 0
                inside = mask & (win > 0)
                carried_mask = mask & (win == 0)
                kv = pltriton.load(kv_ref.at[rows, cols], mask=inside, other=0.0).astype(jnp.float32)
                kv = kv + pltriton.load(
                    prev_kv_ref.at[slots[:, None], chans[None, :]], mask=carried_mask, other=0.0
                )
                sc = jnp.maximum(
                    pltriton.load(sc_ref.at[rows, cols], mask=inside, other=-jnp.inf).astype(jnp.float32),
                    pltriton.load(
                        prev_sc_ref.at[slots[:, None], chans[None, :]], mask=carried_mask, other=-jnp.inf
                    ),
                )
            return absorb(kv.astype(jnp.float32), sc.astype(jnp.float32), state)

        return lax.fori_loop(0, pl.cdiv(m, bs), step, state)

    state = (
        jnp.full((dp,), -jnp.inf, jnp.float32),
        jnp.zeros((dp,), jnp.float32),
        jnp.zeros((dp,), jnp.float32),
    )
    if overlap:
        state = window_pass(state, jnp.maximum(win - 1, 0) * m, 0, carried=True)
    _, denom, acc = window_pass(state, win * m, cd - d, carried=False)
    pooled = jnp.where(chan_ok, acc / jnp.where(denom > 0, denom, 1.0), 0.0)
    inv_rms = lax.rsqrt(jnp.sum(pooled * pooled) / d + eps)
    weight = pltriton.load(norm_ref.at[chans], mask=chan_ok, other=0.0).astype(jnp.float32)
    pltriton.store(
        out_ref.at[win * d + chans], (pooled * inv_rms * weight).astype(out_ref.dtype), mask=chan_ok
    )


def compress_pool(
    kv: jax.Array,
    score: jax.Array,
    norm: jax.Array,
    *,
    eps: float,
    prev_kv: jax.Array | None = None,
    prev_score: jax.Array | None = None,
    interpret: bool = False,
    config: tuning.PoolConfig | None = None,
) -> jax.Array:
    """See :func:`jaxdsa.ops.compress_pool`: kv, score [W, m, c d], norm [d] -> entries [W, d]."""
    w, m, cd = kv.shape
    d = norm.shape[0]
    if score.shape != kv.shape or cd not in (d, 2 * d):
        raise ValueError(f"compress_pool: kv {kv.shape}, score {score.shape}, norm {norm.shape}")
    if w == 0:
        return jnp.zeros((0, d), kv.dtype)
    overlap = cd == 2 * d
    cfg = config or tuning.choose(m, d)
    args = [kv.reshape(w * m, cd), score.reshape(w * m, cd)]
    if overlap:
        if prev_kv is None:
            prev_kv = jnp.zeros((m, d), jnp.float32)
            prev_score = jnp.full((m, d), -jnp.inf, jnp.float32)
        if prev_kv.shape != (m, d) or prev_score.shape != (m, d):
            raise ValueError(f"compress_pool: prev {prev_kv.shape} / {prev_score.shape}, expected {(m, d)}")
        args += [prev_kv.astype(jnp.float32), prev_score.astype(jnp.float32)]
    args.append(norm)
    out = pl.pallas_call(
        functools.partial(_pool_kernel, m=m, d=d, cd=cd, overlap=overlap, eps=eps, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((w * d,), kv.dtype),
        grid=(w,),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="compress_pool",
    )(*args)
    return out.reshape(w, d)
