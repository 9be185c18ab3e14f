"""Tile sizes for the compressor pooling kernel, per GPU compute capability.

One program pools one entry: per step it holds a ``[block_s, d_pad]`` float32 tile of values and
one of scores in registers (no dots, so no shared-memory staging beyond Triton's layout scratch).
``block_s`` = 16 slots keeps those tiles at 2 x 8192 values for the real d = 512 (64 per thread
each at 8 warps); CSA's 4-row windows use a 4-row tile. Wider channel widths get more warps.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import compute_capability, pl, tile_pad


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    block_s: int  # slots per step (power of two)
    d_pad: int  # channels, padded to a power of two
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class _Entry:
    max_block_s: int
    warps_per_256_channels: int
    num_stages: int


TABLE: dict[int, _Entry] = {
    80: _Entry(max_block_s=16, warps_per_256_channels=4, num_stages=2),
    86: _Entry(max_block_s=16, warps_per_256_channels=4, num_stages=2),
    89: _Entry(max_block_s=16, warps_per_256_channels=4, num_stages=2),
    90: _Entry(max_block_s=16, warps_per_256_channels=4, num_stages=2),
    100: _Entry(max_block_s=16, warps_per_256_channels=4, num_stages=2),
    120: _Entry(max_block_s=16, warps_per_256_channels=4, num_stages=2),
    121: _Entry(max_block_s=16, warps_per_256_channels=4, num_stages=2),
}
DEFAULT = _Entry(max_block_s=16, warps_per_256_channels=4, num_stages=2)


def choose(m: int, d: int) -> PoolConfig:
    """Config for windows of ``m`` rows and entries of ``d`` channels."""
    e = TABLE.get(compute_capability(), DEFAULT)
    d_pad = tile_pad(d)
    warps = min(8, max(1, e.warps_per_256_channels * d_pad // 256))
    return PoolConfig(min(e.max_block_s, pl.next_power_of_2(m)), d_pad, warps, e.num_stages)
