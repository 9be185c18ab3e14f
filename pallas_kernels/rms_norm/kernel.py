"""Pallas-Triton residual add + RMSNorm: one program per token row.

A decoder layer adds each sublayer's output to the residual stream and normalizes the sum for the
next sublayer. XLA makes that two or three kernels (the add, the sum of squares, the scaling),
and where the add follows an all-reduce it lands outside the step's CUDA graphs; at decode every
one of them is a launch of a few microseconds for a few kilobytes. Here a program loads its row of
``x`` (and of ``residual``), rounds the sum to the activations' dtype, takes the mean square in
float32 and writes both the normalized row and the sum: the arithmetic of
:func:`pallas_kernels.rms_norm.ref.add_rms_norm`, with the sum of squares reduced in the kernel's
order. A weight stacked over scanned layers is read in place at the traced layer index.

Design notes and measurements: the kernel notes (docs/kernels.md §7).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.quant import tiles


def _kernel(*refs, d: int, block: int, eps: float, has_residual: bool, w_spec: tiles.WeightSpec):
    x_ref, *refs, o_ref, s_ref = refs
    r_ref = refs.pop(0) if has_residual else None
    lead, (w_ref,) = tiles.layer_lead(w_spec, refs)
    row = pl.program_id(0)
    cols = jnp.arange(block, dtype=jnp.int32)
    ok = cols < d
    x = pltriton.load(x_ref.at[row, cols], mask=ok, other=0.0)
    s = x
    if r_ref is not None:
        r = pltriton.load(r_ref.at[row, cols], mask=ok, other=0.0)
        s = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype)
    s32 = s.astype(jnp.float32)
    y = (s32 * lax.rsqrt(jnp.sum(s32 * s32) / d + eps)).astype(s.dtype)
    w = pltriton.load(w_ref.at[(*lead, cols)], mask=ok, other=0.0)
    out = w.astype(jnp.float32) * y.astype(jnp.float32)
    pltriton.store(o_ref.at[row, cols], out.astype(o_ref.dtype), mask=ok)
    pltriton.store(s_ref.at[row, cols], s, mask=ok)


def add_rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    residual: jax.Array | None = None,
    layer: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The kernel of :func:`pallas_kernels.rms_norm.ref.add_rms_norm` (same arguments and results)."""
    return _add_rms_norm(x, weight, residual, layer, eps=float(eps), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _add_rms_norm(x, weight, residual, layer, *, eps: float, interpret: bool):
    t, d = x.shape
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {residual.shape} is not shaped like x {x.shape}")
    if weight.shape[-1] != d or weight.ndim != (1 if layer is None else 2):
        raise ValueError(f"add_rms_norm: weight {weight.shape} for rows of {d} with layer={layer}")
    block = pl.next_power_of_2(d)
    w_spec, w_operands = tiles.operands(weight, layer=layer)
    operands = (x, *(() if residual is None else (residual,)), *w_operands)
    return pl.pallas_call(
        functools.partial(
            _kernel,
            d=d,
            block=block,
            eps=eps,
            has_residual=residual is not None,
            w_spec=w_spec,
        ),
        out_shape=(
            jax.ShapeDtypeStruct((t, d), jnp.result_type(weight.dtype, x.dtype)),
            jax.ShapeDtypeStruct((t, d), x.dtype),
        ),
        grid=(t,),
        compiler_params=compiler_params(num_warps=4 if block <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*operands)
