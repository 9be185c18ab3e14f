"""Device-side routing for the grouped expert GEMMs: token slots grouped into per-expert blocks.

Slot ``s = t * k + j`` is token ``t``'s ``j``-th routed expert. Slots are grouped by expert and
each expert's slots are cut into blocks of ``block_m`` rows; a block is the M tile of one
program, so an expert's weights are streamed once per block (once in total while the expert has
at most ``block_m`` slots). The grid of the kernels is static, so the map is sized for the worst
case (:func:`max_blocks`) and unused blocks are marked idle (expert -1); their programs exit at
once. Each block also carries its expert's span (first block, block count), so the kernels can
number their programs expert by expert (see :func:`pallas_kernels.moe.kernel._block_and_tile`).
Everything here is plain XLA (a sort, a few reductions and one scatter): Pallas-Triton kernels
cannot sort. A single token's map needs none of it (:class:`SlotBlocks`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class BlockMap(NamedTuple):
    block_expert: jax.Array  # [max_blocks] int32: expert of each block, -1 = idle block
    block_rows: jax.Array  # [max_blocks] int32: filled rows (a prefix of the block), 0 = idle
    row_slot: jax.Array  # [max_blocks * block_m] int32: slot held by each block row, -1 = padding
    span_start: jax.Array  # [max_blocks] int32: first block of this block's expert (idle: itself)
    span_len: jax.Array  # [max_blocks] int32: blocks of this block's expert (idle: 1)

    @property
    def n_blocks(self) -> int:
        return self.block_expert.shape[0]


class SlotBlocks(NamedTuple):
    """Every slot its own block, for a single token: its top-k experts are distinct, so grouping
    has nothing to merge. The kernels read the routing ids as they are (block b is slot b, expert
    ``ids[b]``, idle outside ``[0, E)``), so no XLA kernel runs before them: at batch-1 decode the
    map's two small fusions were two launches per MoE layer. :meth:`block_map` is the same map as
    arrays (what the kernels derive, for tests)."""

    ids: jax.Array  # [slots] int32

    @property
    def n_blocks(self) -> int:
        return self.ids.shape[0]

    def block_map(self, num_experts: int, block_m: int) -> BlockMap:
        num_slots = self.ids.shape[0]
        valid = (self.ids >= 0) & (self.ids < num_experts)
        slot = jnp.arange(num_slots, dtype=jnp.int32)
        first_row = jnp.arange(block_m, dtype=jnp.int32)[None, :] == 0
        row_slot = jnp.where(first_row & valid[:, None], slot[:, None], -1)
        block_expert = jnp.where(valid, self.ids, -1)
        return BlockMap(
            block_expert, valid.astype(jnp.int32), row_slot.reshape(-1), slot, jnp.ones_like(slot)
        )


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Most blocks any routing can need.

    With ``n <= min(E, S)`` touched experts holding ``c_e >= 1`` slots each,
    ``sum ceil(c_e / bm) <= sum ((c_e - 1) / bm + 1) = (S - n) / bm + n``, which grows with n.
    """
    m = min(num_experts, num_slots)
    return m + (num_slots - m) // block_m


def group_by_expert(topk_ids: jax.Array, num_experts: int, block_m: int) -> BlockMap:
    """Slots sorted by expert (stable), each expert's run padded to whole blocks.

    Slots with ids outside ``[0, E)`` sort last and land in no block, so they contribute nothing.
    """
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    num_slots = ids.shape[0]
    n_blocks = max_blocks(num_slots, num_experts, block_m)
    key = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    # 16-bit keys halve the radix sort's passes (E <= 32766 always holds for MoE routers).
    narrow = key.astype(jnp.int16) if num_experts < 2**15 - 1 else key
    order = jnp.argsort(narrow, stable=True).astype(jnp.int32)  # sorted row -> slot
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    # group_end[e] = slots with key <= e (cumulative counts, no scatter-add needed)
    group_end = jnp.sum(key[None, :] <= experts[:, None], axis=1, dtype=jnp.int32)
    group_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), group_end[:-1]])
    blocks = (group_end - group_start + block_m - 1) // block_m
    block_end = jnp.cumsum(blocks, dtype=jnp.int32)
    block_start = block_end - blocks

    sorted_key = key[order]
    e = jnp.minimum(sorted_key, num_experts - 1)
    row = jnp.arange(num_slots, dtype=jnp.int32)
    padded_row = block_start[e] * block_m + (row - group_start[e])
    padded_row = jnp.where(sorted_key < num_experts, padded_row, n_blocks * block_m)  # dropped
    row_slot = jnp.full((n_blocks * block_m,), -1, jnp.int32).at[padded_row].set(order, mode="drop")

    # block b belongs to expert #{e : block_end[e] <= b} (block_end is non-decreasing)
    b = jnp.arange(n_blocks, dtype=jnp.int32)
    block_expert = jnp.sum(block_end[None, :] <= b[:, None], axis=1, dtype=jnp.int32)
    idle = block_expert >= num_experts
    owner = jnp.minimum(block_expert, num_experts - 1)
    filled = group_end[owner] - group_start[owner] - (b - block_start[owner]) * block_m
    block_rows = jnp.where(idle, 0, jnp.minimum(filled, block_m))
    span_start = jnp.where(idle, b, block_start[owner])
    span_len = jnp.where(idle, 1, blocks[owner])
    return BlockMap(jnp.where(idle, -1, block_expert), block_rows, row_slot, span_start, span_len)
