"""Pallas-Triton: MLA's absorbed query from ``q_lat`` in two launches, ``q_b``'s and one after it.

At decode XLA builds the absorbed query in three launches after ``q_b``'s quantized matmul (GLM-5.2
INT4, tp 4, one token: 16 heads a GPU, nope 192, rope 64, kv_lora 512): the sum of its K splits
(float32 partials ``[8, 16, 4096]`` to bf16 ``[1, 4096]``), the reduction folding ``q_nope`` through
each head's ``W_UK`` slice (~4 us) and the concatenation with the roped ``q_pe``. Here ``q_b``'s
launch leaves its partial products unsummed
(:func:`pallas_kernels.quant_matmul.kernel.quant_matmul_partials`, padded rows and all) and one
kernel does the rest: the arithmetic of :func:`pallas_kernels.mla_query.ref.mla_query`.

Grid (heads, kv_lora tiles, row tiles). A program adds its head's K splits for the ``q_nope``
columns of its rows (in split order, rounded to the activations' dtype as the sum alone would be)
and multiplies them by its ``[block_c, nope]`` tile of the head's ``W_UK`` (``pl.dot`` over rows
padded to 16 or 32, the decode tiles of ``quant_matmul``: T = 1 is one row of sixteen); the
head's first tile also adds the ``q_pe`` columns and rotates them (NoPE MLA has none). ``block_c`` =
64 bf16 columns gives GLM-5.2 at tp 4 16 x 8 = 128 programs, about one per SM of an H200, each
reading 24 KiB of ``W_UK`` (float32 takes 32 columns: the dot's two operands, through shared memory
once, then come to at most 64 KiB, inside sm_120's 99). A ``W_UK`` stacked over scanned layers is
read in place at the layer index (:func:`pallas_kernels.quant.tiles.operands`), as ``q_b``'s stack is
by its launch.

Rows past :data:`MAX_ROWS` (prefill) run in more row tiles, each reading ``W_UK`` again, where
XLA's einsum reads it once: :class:`jaxdsa.layers.mla.MLAttention` takes the op up to there.

Design notes and measurements: the kernel notes (docs/kernels.md §6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, dot_precision, fit_block, pl, pltriton, tile_pad
from pallas_kernels.quant import tiles
from pallas_kernels.quant.layout import QuantizedWeight
from pallas_kernels.quant_matmul import kernel as quant_matmul_kernel
from pallas_kernels.quant_matmul.tuning import STREAM_MAX_M

MAX_ROWS = STREAM_MAX_M  # decode: rows in one tile, as in q_b's launch
_TILE_BYTES = 128  # W_UK columns per program times the activations' itemsize


def _kernel(
    parts_ref,
    *refs,
    splits: int,
    t: int,
    block_t: int,
    nope: int,
    rope: int,
    c: int,
    block_c: int,
    w_spec,
    dtype,
    precision,
):
    lead, (w_ref, *refs) = tiles.layer_lead(w_spec, refs)
    cos_ref, sin_ref, o_ref = refs if rope else (None, None, *refs)  # NoPE MLA (GLM-5.3-Flash): no angles
    h, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = i * block_t + jnp.arange(block_t, dtype=jnp.int32)
    # masked rows and columns are left pointing past the arrays, not clamped: the interpreter's masked
    # store writes the old values back at the masked indices, so a clamped duplicate of a live one
    # could undo its write
    live = rows < t
    first = h * (nope + rope)  # the head's columns in q_b's product

    def summed(cols, ok) -> jax.Array:
        """``[block_t, len(cols)]``: the K splits' sum at this head's ``cols`` of the rows, rounded to
        the activations' dtype (0 where masked)."""
        mask = live[:, None] & ok[None, :]
        at = (rows[:, None], first + cols[None, :])
        acc = pltriton.load(parts_ref.at[(0, *at)], mask=mask, other=0.0).astype(jnp.float32)
        for s in range(1, splits):
            acc += pltriton.load(parts_ref.at[(s, *at)], mask=mask, other=0.0).astype(jnp.float32)
        return acc.astype(dtype)

    dn = jnp.arange(tile_pad(nope), dtype=jnp.int32)
    ok = dn < nope
    q_nope = summed(dn, ok)
    cs = j * block_c + jnp.arange(block_c, dtype=jnp.int32)
    w = pltriton.load(w_ref.at[(*lead, cs[:, None], h, dn[None, :])], mask=ok[None, :], other=0.0)
    q_abs = lax.dot_general(
        q_nope,
        w.astype(dtype),
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    pltriton.store(o_ref.at[rows[:, None], h, cs[None, :]], q_abs.astype(dtype), mask=live[:, None])
    if not rope:
        return

    @pl.when(j == 0)
    def _rope():
        pairs = jnp.arange(pl.next_power_of_2(rope // 2), dtype=jnp.int32)
        ok = pairs < rope // 2
        mask = live[:, None] & ok[None, :]
        a = summed(nope + 2 * pairs, ok).astype(jnp.float32)
        b = summed(nope + 2 * pairs + 1, ok).astype(jnp.float32)
        at = (rows[:, None], pairs[None, :])
        cos = pltriton.load(cos_ref.at[at], mask=mask, other=0.0)
        sin = pltriton.load(sin_ref.at[at], mask=mask, other=0.0)
        col = c + 2 * pairs[None, :]  # q_pe's columns follow the C latent ones
        pltriton.store(o_ref.at[rows[:, None], h, col], (a * cos - b * sin).astype(dtype), mask=mask)
        pltriton.store(o_ref.at[rows[:, None], h, col + 1], (b * cos + a * sin).astype(dtype), mask=mask)


def mla_query(
    q_lat: jax.Array,
    q_b: QuantizedWeight,
    w_uk: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    nope: int,
    layer: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The kernel of :func:`pallas_kernels.mla_query.ref.mla_query` (same arguments and result). A
    ``q_b`` that does not take the partial-products launch (a width not a multiple of 16,
    prefill-sized T) is multiplied whole and the kernel takes its product as a single "split"."""
    parts = quant_matmul_kernel.quant_matmul_partials(q_lat, (q_b,), layer=layer, interpret=interpret)
    if parts is None:
        parts = quant_matmul_kernel.quant_matmul(q_lat, q_b, layer=layer, interpret=interpret)[None]
    return _query(
        parts, w_uk, cos, sin, layer, t=q_lat.shape[0], nope=nope, dtype=q_lat.dtype, interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=("t", "nope", "dtype", "interpret"))
def _query(parts, w_uk, cos, sin, layer, *, t: int, nope: int, dtype, interpret: bool):
    """The kernel over the first ``t`` rows of ``parts [splits, >= t, H * (nope + P)]``."""
    c, heads = w_uk.shape[-3:-1]
    rope = parts.shape[-1] // heads - nope
    if (
        w_uk.shape[-1] != nope
        or parts.shape[-1] != heads * (nope + rope)
        or rope < 0
        or rope % 2
        or cos.shape != (t, rope // 2)
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"mla_query: q_b's product {parts.shape[-1]} wide, w_uk {w_uk.shape}, nope {nope}, cos "
            f"{cos.shape} for {t} rows do not fit"
        )
    block_t = 16 if t <= 16 else MAX_ROWS
    block_c = fit_block(_TILE_BYTES // jnp.dtype(dtype).itemsize, c, floor=16, what="kv_lora", op="mla_query")
    w_spec, w_operands = tiles.operands(w_uk, layer=layer)
    body = functools.partial(
        _kernel,
        splits=parts.shape[0],
        t=t,
        block_t=block_t,
        nope=nope,
        rope=rope,
        c=c,
        block_c=block_c,
        w_spec=w_spec,
        dtype=dtype,
        precision=dot_precision(dtype),
    )
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((t, heads, c + rope), dtype),
        grid=(heads, c // block_c, pl.cdiv(t, block_t)),
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mla_query",
    )(parts, *w_operands, *((cos.astype(jnp.float32), sin.astype(jnp.float32)) if rope else ()))
