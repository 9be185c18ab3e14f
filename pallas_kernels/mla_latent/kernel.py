"""Pallas-Triton: MLA's latent projections and the norms and RoPE after them, in two launches.

A decode step's MLA layer projects its input through ``q_a``, ``kv_a`` and the indexer's ``wk`` in one
``quant_matmul_many`` launch, whose K splits XLA then adds in a fusion of its own; the sum of squares
of ``q_a``'s and of the latent's rows are two more (reductions), and the scaling of ``q_lat`` a fourth,
each a few microseconds of GPU time and, inside a CUDA graph, of the host's to launch. Here the
projections' launch leaves its float32 partial products unsummed
(:func:`pallas_kernels.quant_matmul.kernel.quant_matmul_partials`) and one program per token row adds
the splits, rounds the sum to the activations' dtype as the sum alone would be, and writes ``q_lat``
(RMSNorm), the token's cached row (RMSNorm of the latent, interleaved RoPE of ``k_pe``, which NoPE MLA
has none of) and ``wk``'s product: the arithmetic of :func:`pallas_kernels.mla_latent.ref.mla_latent`,
the sums of squares in the kernel's order. Norm weights stacked over scanned layers are read in place
at the layer index. Weights that do not share one launch (prefill-sized M, mixed formats) are
multiplied one by one and the same row kernel takes their products as a single "split".

Design notes and measurements: the kernel notes (docs/kernels.md §6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.quant import tiles
from pallas_kernels.quant.layout import QuantizedWeight
from pallas_kernels.quant_matmul import kernel as quant_matmul_kernel


def _kernel(*refs, splits: int, q: int, c: int, p: int, d: int, eps: float, q_spec, kv_spec, dtype):
    parts_ref, *refs = refs
    q_lead, (qn_ref, *refs) = tiles.layer_lead(q_spec, refs)
    kv_lead, (kvn_ref, *refs) = tiles.layer_lead(kv_spec, refs)
    cos_ref, sin_ref, *refs = refs if p else (None, None, *refs)  # NoPE MLA (GLM-5.3-Flash): no angles
    q_ref, row_ref, *wk_ref = refs
    row = pl.program_id(0)

    def summed(cols, ok):
        """The K splits' sum at ``cols`` of this row, rounded to the activations' dtype."""
        acc = pltriton.load(parts_ref.at[0, row, cols], mask=ok, other=0.0).astype(jnp.float32)
        for s in range(1, splits):
            acc += pltriton.load(parts_ref.at[s, row, cols], mask=ok, other=0.0).astype(jnp.float32)
        return acc.astype(dtype)

    def normed(start: int, width: int, w_ref, lead) -> tuple[jax.Array, jax.Array, jax.Array]:
        cols = jnp.arange(pl.next_power_of_2(width), dtype=jnp.int32)
        ok = cols < width
        v32 = summed(start + cols, ok).astype(jnp.float32)
        y = (v32 * lax.rsqrt(jnp.sum(v32 * v32) / width + eps)).astype(dtype)
        w = pltriton.load(w_ref.at[(*lead, cols)], mask=ok, other=0.0)
        return cols, ok, (w.astype(jnp.float32) * y.astype(jnp.float32)).astype(dtype)

    cols, ok, q_lat = normed(0, q, qn_ref, q_lead)
    pltriton.store(q_ref.at[row, cols], q_lat, mask=ok)
    cols, ok, latent = normed(q, c, kvn_ref, kv_lead)
    pltriton.store(row_ref.at[row, cols], latent, mask=ok)

    if p:
        pairs = jnp.arange(pl.next_power_of_2(p // 2), dtype=jnp.int32)
        ok = pairs < p // 2
        a = summed(q + c + 2 * pairs, ok).astype(jnp.float32)
        b = summed(q + c + 2 * pairs + 1, ok).astype(jnp.float32)
        cos = pltriton.load(cos_ref.at[row, pairs], mask=ok, other=0.0)
        sin = pltriton.load(sin_ref.at[row, pairs], mask=ok, other=0.0)
        pltriton.store(row_ref.at[row, c + 2 * pairs], (a * cos - b * sin).astype(dtype), mask=ok)
        pltriton.store(row_ref.at[row, c + 2 * pairs + 1], (b * cos + a * sin).astype(dtype), mask=ok)

    if d:
        cols = jnp.arange(pl.next_power_of_2(d), dtype=jnp.int32)
        ok = cols < d
        pltriton.store(wk_ref[0].at[row, cols], summed(q + c + p + cols, ok), mask=ok)


def mla_latent(
    x: jax.Array,
    ws: tuple[QuantizedWeight, ...],
    q_norm: jax.Array,
    kv_norm: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    eps: float,
    layer: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """The kernel of :func:`pallas_kernels.mla_latent.ref.mla_latent` (same arguments and results)."""
    if len(ws) not in (2, 3):
        raise ValueError(f"mla_latent: q_a, kv_a and optionally wk, not {len(ws)} weights")
    parts = quant_matmul_kernel.quant_matmul_partials(x, tuple(ws), layer=layer, interpret=interpret)
    if parts is None:
        products = quant_matmul_kernel.quant_matmul_many(x, tuple(ws), layer=layer, interpret=interpret)
        parts = jnp.concatenate(products, axis=-1)[None]
    widths = tuple(w.shape[-1] for w in ws)
    return _rows(parts, q_norm, kv_norm, cos, sin, layer, t=x.shape[0], widths=widths, eps=float(eps),
                 dtype=x.dtype, interpret=interpret)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("t", "widths", "eps", "dtype", "interpret"))
def _rows(parts, q_norm, kv_norm, cos, sin, layer, *, t: int, widths, eps: float, dtype, interpret: bool):
    """The row kernel over the first ``t`` rows of ``parts [splits, >= t, sum(widths)]`` (the
    projections' launch pads its rows to its tile)."""
    splits = parts.shape[0]
    q, latent, *wk = widths
    c = kv_norm.shape[-1]
    p, d = latent - c, (wk[0] if wk else 0)
    if q_norm.shape[-1] != q or p < 0 or p % 2 or cos.shape != (t, p // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"mla_latent: q_a {q} / q_norm {q_norm.shape}, kv_a {latent} / kv_norm {kv_norm.shape}, "
            f"cos {cos.shape} for {t} rows do not fit"
        )
    q_spec, q_operands = tiles.operands(q_norm, layer=layer)
    kv_spec, kv_operands = tiles.operands(kv_norm, layer=layer)
    out = [jax.ShapeDtypeStruct((t, q), dtype), jax.ShapeDtypeStruct((t, latent), dtype)]
    out += [jax.ShapeDtypeStruct((t, d), dtype)] if d else []
    return pl.pallas_call(
        functools.partial(
            _kernel, splits=splits, q=q, c=c, p=p, d=d, eps=eps, q_spec=q_spec, kv_spec=kv_spec, dtype=dtype
        ),
        out_shape=tuple(out),
        grid=(t,),
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mla_latent",
    )(parts, *q_operands, *kv_operands, *((cos.astype(jnp.float32), sin.astype(jnp.float32)) if p else ()))
