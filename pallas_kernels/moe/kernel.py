"""Pallas-Triton MoE experts: grouped SwiGLU GEMMs that read only the experts a batch touches.

Three steps, all inside the caller's jit:

1. Routing (:mod:`.routing`, plain XLA): token slots grouped by expert into blocks of
   ``block_m`` rows; a block map of static worst-case size with idle blocks marked -1.
2. ``gate_up`` kernel: one program per (block, N tile). It gathers the block's token rows of
   ``x`` straight from ``[T, D]`` (no permuted copy of the activations), multiplies them with the
   expert's gate and up tiles in one K loop (two f32 accumulators), and applies the clamp and
   SwiGLU in the epilogue, writing ``act`` in block-padded row order (padding rows are exactly 0).
3. ``down`` kernel: one program per (block, D tile); ``act @ down_e``, rows scattered back to
   slot order ``[T * k, D]``; the weighted sum over the k slots of a token is one XLA fusion.

Idle programs (blocks beyond the routing's need, or blocks of a filtered expert) exit at once.
Programs are numbered output tile fastest, so all tiles of a block run side by side (its
gathered ``x`` rows stay in L2) and the blocks of one expert meet the same weight tile close
together in time (a second block's weight reads come from L2). With decode-sized batches
``block_m`` almost always covers all of an expert's slots, so each touched expert's weights are
streamed from HBM once (see :mod:`.tuning`). Both kernels read weights only through
:func:`_weight_tile` (``[block_k, block_n]`` slices of the packed arrays), the one place a fused
dequantize step would go.

Loads and stores that can touch padding (the gathered ``x`` rows, the ``y`` scatter) carry
explicit masks and ``other``; the weight, ``act`` and block-map accesses are in bounds by
construction (tiles divide D and N, nothing overhangs), so JAX 0.11.2 and 0.12 agree.

Weights use :func:`.ref.pack_experts`'s layout (``gate_up [E, D, 2N]``, ``down [E, N, D]``), so
packed weights work with the reference backend too and switching backends needs no repacking.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._triton import compiler_params, pl, pltriton
from pallas_kernels.moe import ref, routing, tuning

__all__ = ["moe_experts", "pack_experts"]


def pack_experts(gate: jax.Array, up: jax.Array, down: jax.Array, *, interpret: bool = False) -> dict:
    """HF [out, in] matrices -> ``{'gate_up': [E, D, 2N], 'down': [E, N, D]}`` (the reference layout).

    The kernels read ``[block_k, block_n]`` tiles with the output dim contiguous, which is this
    layout. ``interpret`` is accepted because :mod:`jaxdsa.ops` passes it to every kernel entry
    point; packing is plain XLA either way.
    """
    del interpret
    return ref.pack_experts(gate, up, down)


def _fit(block: int, dim: int, what: str) -> int:
    """Largest power of two <= ``block`` dividing ``dim`` (so weight tiles are never partial)."""
    b = block
    while b >= 16 and (b > dim or dim % b):
        b //= 2
    if b < 16:
        raise ValueError(f"moe_experts needs {what} = {dim} to be a multiple of 16")
    return b


def _weight_tile(w_ref, expert, k0, n0, block_k: int, block_n: int) -> jax.Array:
    """``[block_k, block_n]`` tile of one expert's ``[K, N']`` matrix: the single place a fused
    dequantize step would go (load INT4/FP8 codes and their group scales with the same indexing;
    with 128x128 FP8 blocks a tile of <= 128 x 128 at aligned offsets needs one scale)."""
    return w_ref[expert, pl.ds(k0, block_k), pl.ds(n0, block_n)]


def _gate_up_kernel(block_expert_ref, row_slot_ref, x_ref, w_ref, act_ref, *,
                    top_k: int, block_m: int, block_n: int, block_k: int, n_tiles: int,
                    swiglu_limit: float | None, precision):
    block = pl.program_id(0) // n_tiles
    n0 = pl.multiple_of((pl.program_id(0) % n_tiles) * block_n, block_n)
    expert = block_expert_ref[block]
    d_model = x_ref.shape[1]
    n_inter = w_ref.shape[2] // 2

    @pl.when(expert >= 0)
    def _():
        rows = pl.ds(pl.multiple_of(block * block_m, block_m), block_m)
        slots = row_slot_ref[rows]
        valid = slots >= 0
        tokens = jnp.where(valid, slots // top_k, 0)

        def step(i, acc):
            gate, up = acc
            k0 = pl.multiple_of(i * block_k, block_k)
            cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
            xs = pltriton.load(x_ref.at[tokens[:, None], cols[None, :]], mask=valid[:, None], other=0)
            w_gate = _weight_tile(w_ref, expert, k0, n0, block_k, block_n)
            w_up = _weight_tile(w_ref, expert, k0, n_inter + n0, block_k, block_n)
            gate += jnp.dot(xs, w_gate, preferred_element_type=jnp.float32, precision=precision)
            up += jnp.dot(xs, w_up, preferred_element_type=jnp.float32, precision=precision)
            return gate, up

        zeros = jnp.zeros((block_m, block_n), jnp.float32)
        gate, up = jax.lax.fori_loop(0, d_model // block_k, step, (zeros, zeros))
        if swiglu_limit is not None:
            gate = jnp.minimum(gate, swiglu_limit)
            up = jnp.clip(up, -swiglu_limit, swiglu_limit)
        act_ref[rows, pl.ds(n0, block_n)] = (jax.nn.silu(gate) * up).astype(act_ref.dtype)


def _down_kernel(block_expert_ref, row_slot_ref, act_ref, w_ref, y_ref, *,
                 block_m: int, block_n: int, block_k: int, n_tiles: int, precision):
    block = pl.program_id(0) // n_tiles
    d0 = pl.multiple_of((pl.program_id(0) % n_tiles) * block_n, block_n)
    expert = block_expert_ref[block]
    n_inter = act_ref.shape[1]

    @pl.when(expert >= 0)
    def _():
        rows = pl.ds(pl.multiple_of(block * block_m, block_m), block_m)

        def step(i, acc):
            k0 = pl.multiple_of(i * block_k, block_k)
            a = act_ref[rows, pl.ds(k0, block_k)]
            w = _weight_tile(w_ref, expert, k0, d0, block_k, block_n)
            return acc + jnp.dot(a, w, preferred_element_type=jnp.float32, precision=precision)

        acc = jax.lax.fori_loop(0, n_inter // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))
        slots = row_slot_ref[rows]
        valid = slots >= 0
        # Padding rows aim at distinct spare rows past the slots: masked off on the GPU, and the
        # interpreter (which writes masked lanes back unchanged) sees no duplicate destinations.
        spare = y_ref.shape[0] - block_m + jnp.arange(block_m, dtype=jnp.int32)
        cols = d0 + jnp.arange(block_n, dtype=jnp.int32)
        dest = y_ref.at[jnp.where(valid, slots, spare)[:, None], cols[None, :]]
        pltriton.store(dest, acc.astype(y_ref.dtype), mask=valid[:, None])


def moe_experts(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, experts: dict, *,
                swiglu_limit: float | None = None, interpret: bool = False,
                config: tuning.MoeConfig | None = None) -> jax.Array:
    """out[t] = sum_j w[t,j] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t,j].

    x [T, D]; topk_ids [T, k] int32 (ids outside [0, E) contribute nothing); topk_weights [T, k];
    experts from :func:`pack_experts`. ``swiglu_limit`` clamps gate to <= limit and up to
    [-limit, limit]. ``config`` overrides the tuning table (benchmark sweeps). D and N must be
    multiples of 16. Returns [T, D] in x's dtype.
    """
    gate_up, down = experts["gate_up"], experts["down"]
    num_experts, d_model, two_n = gate_up.shape
    n_inter = two_n // 2
    n_tokens, top_k = topk_ids.shape
    num_slots = n_tokens * top_k
    dtype = gate_up.dtype
    cfg = config or tuning.choose(num_slots, num_experts, itemsize=dtype.itemsize)
    bm = cfg.block_m
    gu_n, gu_k = _fit(cfg.gate_up.block_n, n_inter, "N"), _fit(cfg.gate_up.block_k, d_model, "D")
    dn_n, dn_k = _fit(cfg.down.block_n, d_model, "D"), _fit(cfg.down.block_k, n_inter, "N")
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    if n_tokens == 1:
        bmap = routing.one_block_per_slot(topk_ids, num_experts, bm)
    else:
        bmap = routing.group_by_expert(topk_ids, num_experts, bm)
    n_blocks = bmap.block_expert.shape[0]

    gu_tiles = n_inter // gu_n
    act = pl.pallas_call(
        functools.partial(_gate_up_kernel, top_k=top_k, block_m=bm, block_n=gu_n, block_k=gu_k,
                          n_tiles=gu_tiles, swiglu_limit=swiglu_limit, precision=precision),
        out_shape=jax.ShapeDtypeStruct((n_blocks * bm, n_inter), dtype),
        grid=(n_blocks * gu_tiles,),
        compiler_params=compiler_params(cfg.gate_up.num_warps, cfg.gate_up.num_stages),
        interpret=interpret,
        name="moe_gate_up",
    )(bmap.block_expert, bmap.row_slot, x.astype(dtype), gate_up)

    dn_tiles = d_model // dn_n
    y = pl.pallas_call(
        functools.partial(_down_kernel, block_m=bm, block_n=dn_n, block_k=dn_k, n_tiles=dn_tiles,
                          precision=precision),
        out_shape=jax.ShapeDtypeStruct((num_slots + bm, d_model), dtype),
        grid=(n_blocks * dn_tiles,),
        compiler_params=compiler_params(cfg.down.num_warps, cfg.down.num_stages),
        interpret=interpret,
        name="moe_down",
    )(bmap.block_expert, bmap.row_slot, act, down)

    # Rows of filtered slots were never written: select, never multiply, so garbage cannot leak.
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    y = y[:num_slots].reshape(n_tokens, top_k, d_model).astype(jnp.float32)
    weighted = jnp.where(valid[..., None], y * topk_weights.astype(jnp.float32)[..., None], 0.0)
    return weighted.sum(axis=1).astype(x.dtype)
