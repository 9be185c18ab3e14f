"""Tile sizes for the LSE-merge kernel, per GPU compute capability.

The merge streams n parts into one output. A program owns ``block_rows`` rows x ``block_d``
columns of the flattened ``[T*H, D]`` output and loads up to ``block_parts`` parts of them as one
``[block_rows, block_parts, block_d]`` tile, so the usual case (n <= 64 K splits) is a single
load per program: no loop-carried latency, which is what B = 1 decode needs. The tile is held
near ``tile_elems`` float32 values (registers); rows are then halved until the grid has about one
program per SM, so small merges spread over the GPU instead of queueing on a few SMs.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import compute_capability, pl, sm_count

MAX_BLOCK_PARTS = 64


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    block_rows: int  # output rows per program (power of two)
    block_parts: int  # parts loaded per step (power of two)
    block_d: int  # output columns per program (power of two)
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class _Entry:
    tile_elems: int  # float32 values per [rows, parts, cols] tile
    max_block_d: int
    num_warps: int
    num_stages: int


# One entry for every part (their rows differed only in the SM count, now :func:`sm_count`'s).
DEFAULT = _Entry(tile_elems=4096, max_block_d=256, num_warps=4, num_stages=2)
TABLE: dict[int, _Entry] = dict.fromkeys((80, 86, 89, 90, 100, 120, 121), DEFAULT)


def choose(n_parts: int, rows: int, d: int) -> MergeConfig:
    """Config for merging ``n_parts`` parts of ``rows`` x ``d`` outputs."""
    cc = compute_capability()
    e = TABLE.get(cc, DEFAULT)
    block_parts = min(pl.next_power_of_2(n_parts), MAX_BLOCK_PARTS)
    block_d = min(e.max_block_d, pl.next_power_of_2(d), max(32, e.tile_elems // block_parts))
    block_rows = max(1, e.tile_elems // (block_parts * block_d))
    col_blocks, sms = -(-d // block_d), sm_count(cc)
    while block_rows > 1 and -(-rows // block_rows) * col_blocks < sms:
        block_rows //= 2
    return MergeConfig(block_rows, block_parts, block_d, e.num_warps, e.num_stages)
