"""Pallas-Triton expert selection of the MoE router: everything after the logits in one kernel.

Grid ``(T,)``: one program per token row holds the row's E logits in registers and does

1. ``scores = sigmoid(logits)``, ``choice = scores + bias``;
2. with ``n_group > 1``, the same values in a ``[n_group, E / n_group]`` view (a second load of
   the row, from cache): each group's top-2 sum (max, then the max without the lowest-index
   maximum), then ``topk_group`` rounds of argmax over the group scores, which set bits of a keep
   mask; experts of the other groups get ``choice = -inf``;
3. ``top_k`` rounds of argmax over the row (lowest index among equal maxima, as ``lax.top_k``),
   each taking its winner out of the row. The argmax runs on order-preserving int32 keys of
   ``choice`` with taken experts at INT32_MIN, below the key of -inf, so masked-out experts (-inf)
   are still taken in index order when ``top_k`` exceeds the eligible experts, as ``lax.top_k``
   does;
4. the weights: the unbiased scores of the winners (one ``[top_k, E]`` compare-and-reduce),
   normalized and scaled; ids and weights go out with masked stores.

The alternative in XLA is about six small kernels per layer (sigmoid and bias, group scores,
``lax.top_k`` as a sort, gather, normalize), each a launch at decode. Everything is float32; the
ids equal the reference's whenever there are no exact ties (the sigmoid here is
``1 / (1 + exp(-x))``, which may differ from XLA's in the last bit). E need not be a power of two:
the row and the groups are padded to powers of two, padded experts never win.

Design notes and measurements: the kernel notes (docs/kernels.md §4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.quant import tiles

_INT32_MIN = -(2**31)
_NEG_INF_KEY = -(2**31) + 2**23 - 1  # _ordered_key(-inf): above INT32_MIN, below every finite key
_MAX_GROUPS = 32  # the eligible groups are bits of one int32


def _ordered_key(x: jax.Array) -> jax.Array:
    """f32 -> int32 with the same order (-inf maps above INT32_MIN; NaN is not expected)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _num_warps(e_pad: int) -> int:
    """One warp up to 512 experts: every round is a reduction over the row, and within one warp
    it needs no shared memory or barrier (latency is all that counts at these sizes)."""
    return max(1, min(4, e_pad // 512))


def _router_kernel(
    *refs,
    bias_spec: tiles.WeightSpec,
    e: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    shared_slot: int | None,
):
    logits_ref, *bias_refs, ids_ref, weights_ref = refs
    lead, (bias_ref,) = tiles.layer_lead(bias_spec, bias_refs)
    row = pl.program_id(0)
    e_pad = pl.next_power_of_2(e)
    lanes = jnp.arange(e_pad, dtype=jnp.int32)
    real = lanes < e
    x = pltriton.load(logits_ref.at[row, lanes], mask=real, other=0.0)
    b = pltriton.load(bias_ref.at[(*lead, lanes)], mask=real, other=0.0)
    scores = jax.nn.sigmoid(x)
    key = jnp.where(real, _ordered_key(scores + b), _INT32_MIN)

    if n_group > 1:
        size = e // n_group
        g_pad, s_pad = pl.next_power_of_2(n_group), pl.next_power_of_2(size)
        groups = jnp.arange(g_pad, dtype=jnp.int32)
        cols = jnp.arange(s_pad, dtype=jnp.int32)[None, :]
        ok = (groups < n_group)[:, None] & (cols < size)
        flat = groups[:, None] * size + cols
        gx = pltriton.load(logits_ref.at[row, flat], mask=ok, other=0.0)
        gb = pltriton.load(bias_ref.at[(*lead, flat)], mask=ok, other=0.0)
        gchoice = jnp.where(ok, jax.nn.sigmoid(gx) + gb, -jnp.inf)
        first = jnp.argmax(gchoice, axis=1).astype(jnp.int32)
        top1 = jnp.max(gchoice, axis=1)
        top2 = jnp.max(jnp.where(cols == first[:, None], -jnp.inf, gchoice), axis=1)
        gscore = jnp.where(groups < n_group, top1 + top2, -jnp.inf)
        keep = jnp.int32(0)
        for _ in range(topk_group):
            best = jnp.argmax(gscore).astype(jnp.int32)
            keep = keep | jnp.left_shift(jnp.int32(1), best)
            gscore = jnp.where(groups == best, -jnp.inf, gscore)
        group = lax.div(jnp.minimum(lanes, e - 1), jnp.int32(size))  # padded lanes: the last group
        eligible = (jnp.right_shift(keep, group) & 1) == 1
        key = jnp.where(real & ~eligible, _NEG_INF_KEY, key)

    k_pad = pl.next_power_of_2(top_k + (shared_slot is not None))
    slots = jnp.arange(k_pad, dtype=jnp.int32)
    ids = jnp.full((k_pad,), -1, jnp.int32)
    for i in range(top_k):
        best = jnp.argmax(key).astype(jnp.int32)
        ids = jnp.where(slots == i, best, ids)
        key = jnp.where(lanes == best, _INT32_MIN, key)
    weights = jnp.max(jnp.where(lanes[None, :] == ids[:, None], scores[None, :], -jnp.inf), axis=1)
    weights = jnp.where(slots < top_k, weights, 0.0)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights) + 1e-20)
    weights = weights * scaling
    if shared_slot is not None:  # the shared expert held as one more, at weight 1
        ids = jnp.where(slots == top_k, shared_slot, ids)
        weights = jnp.where(slots == top_k, 1.0, weights)
    out = slots < top_k + (shared_slot is not None)
    pltriton.store(ids_ref.at[row, slots], ids, mask=out)
    pltriton.store(weights_ref.at[row, slots], weights, mask=out)


def _check(e: int, top_k: int, n_group: int, topk_group: int) -> None:
    if not 1 <= top_k <= e:
        raise ValueError(f"select_experts: top_k={top_k} must be in [1, {e}] (E={e} experts)")
    if n_group > 1:
        if n_group > _MAX_GROUPS:
            raise ValueError(f"select_experts: n_group={n_group} > {_MAX_GROUPS} is not supported")
        if e % n_group or e // n_group < 2:
            raise ValueError(
                f"select_experts: E={e} experts do not form n_group={n_group} groups of at least 2"
            )
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"select_experts: topk_group={topk_group} must be in [1, n_group={n_group}]")


@functools.partial(
    jax.jit,
    static_argnames=(
        "top_k",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "scaling",
        "shared_slot",
        "interpret",
    ),
)
def select_experts(
    logits: jax.Array,
    bias: jax.Array,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    layer: jax.Array | None = None,
    shared_slot: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`jaxdsa.ops.select_experts`.

    logits [T,E] f32, bias [E] f32 (or a stack [L, E] read in place at ``layer``, an int32 scalar)
    -> (ids [T,k] int32, weights [T,k] f32), k = top_k, + 1 with ``shared_slot``.
    """
    t, e = logits.shape
    if bias.shape[-1:] != (e,) or bias.ndim != (1 if layer is None else 2):
        raise ValueError(
            f"select_experts: bias {bias.shape} with layer={layer} does not match logits {logits.shape}"
        )
    _check(e, top_k, n_group, topk_group)
    k = top_k + (shared_slot is not None)
    if t == 0:
        return jnp.zeros((0, k), jnp.int32), jnp.zeros((0, k), jnp.float32)
    bias_spec, bias_operands = tiles.operands(bias.astype(jnp.float32), layer=layer)
    kernel = functools.partial(
        _router_kernel,
        bias_spec=bias_spec,
        e=e,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        scaling=float(scaling),
        shared_slot=shared_slot,
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((t, k), jnp.int32),
            jax.ShapeDtypeStruct((t, k), jnp.float32),
        ),
        grid=(t,),
        compiler_params=compiler_params(_num_warps(pl.next_power_of_2(e)), 1),
        interpret=interpret,
        name="select_experts",
    )(logits.astype(jnp.float32), *bias_operands)
