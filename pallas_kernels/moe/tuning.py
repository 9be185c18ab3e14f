"""Tile sizes, warps and stages for the MoE expert kernels, per GPU compute capability.

Both kernels run one program per (block of ``block_m`` token slots of one expert, output tile),
so ``block_m`` decides how often an expert's weights are streamed: once per block. It is picked
from the mean number of slots per expert, ``S / E``, as the smallest power of two >= ``2 S / E``
(16 at least, the MMA minimum): decode-sized batches (GLM-5: T <= 256 at top-8 of 256 experts,
at most 8 slots per expert on average) get 16-row blocks that almost always hold all of an
expert's slots, so every touched expert is read once and the kernels are pure weight streams
(the rare second block of an expert runs next to the first and reads the weights from L2).
Larger batches grow the block up to the table's ``max_block_m``; beyond it bigger blocks mostly
add padding rows (GLM-5 at T = 4096 has ~128 slots per expert: 64-row blocks pad ~25 %,
128-row blocks ~50 %).

Two tile sets per GPU: ``stream`` (``block_m <= 32``: weight bandwidth; deep pipelines of wide
weight tiles keep enough bytes in flight per SM) and ``compute`` (``block_m >= 64``: tensor-core
tiles). Shared memory per stage is ``(block_m*block_k + w*block_k*block_n) * 2`` bytes with
``w = 2`` for gate|up (two weight tiles) and ``w = 1`` for down; the stage counts below keep it
under ~227 KiB on sm_90/sm_100, 163 KiB on sm_80, 99 KiB on sm_86/89/120/121 and unknown parts.
These are reasoned starting points; ``benchmarks/moe.py`` sweeps variants on the GPU.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import compute_capability


@dataclasses.dataclass(frozen=True)
class Tile:
    block_n: int  # output columns per program: N (gate|up kernel) or D (down kernel)
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    block_m: int  # token slots per block; every block belongs to one expert
    gate_up: Tile
    down: Tile


@dataclasses.dataclass(frozen=True)
class _Entry:
    stream_gate_up: Tile
    stream_down: Tile
    compute_gate_up: Tile
    compute_down: Tile
    max_block_m: int = 64


_BIG_SMEM = _Entry(  # sm_90 / sm_100: ~227 KiB
    stream_gate_up=Tile(block_n=64, block_k=128, num_warps=4, num_stages=4),
    stream_down=Tile(block_n=64, block_k=128, num_warps=4, num_stages=4),
    compute_gate_up=Tile(block_n=128, block_k=64, num_warps=8, num_stages=3),
    compute_down=Tile(block_n=128, block_k=64, num_warps=4, num_stages=4),
)
_A100 = _Entry(  # 163 KiB
    stream_gate_up=Tile(block_n=64, block_k=128, num_warps=4, num_stages=3),
    stream_down=Tile(block_n=64, block_k=128, num_warps=4, num_stages=4),
    compute_gate_up=Tile(block_n=128, block_k=64, num_warps=8, num_stages=3),
    compute_down=Tile(block_n=128, block_k=64, num_warps=4, num_stages=4),
)
_SMALL_SMEM = _Entry(  # 99 KiB consumer parts
    stream_gate_up=Tile(block_n=64, block_k=64, num_warps=4, num_stages=4),
    stream_down=Tile(block_n=64, block_k=128, num_warps=4, num_stages=3),
    compute_gate_up=Tile(block_n=64, block_k=64, num_warps=4, num_stages=3),
    compute_down=Tile(block_n=128, block_k=64, num_warps=4, num_stages=3),
)

TABLE: dict[int, _Entry] = {
    80: _A100,
    86: _SMALL_SMEM,
    89: _SMALL_SMEM,
    90: _BIG_SMEM,
    100: _BIG_SMEM,
    120: _SMALL_SMEM,
    121: _SMALL_SMEM,
}
# Unknown GPU (and the CPU interpreter): sized for the smallest shared memory so it compiles.
DEFAULT = _SMALL_SMEM


def block_m_for(num_slots: int, num_experts: int, max_block_m: int) -> int:
    """Smallest power of two >= 2 * mean slots per expert, clamped to [16, max_block_m]."""
    block_m = 16
    while block_m < max_block_m and block_m * num_experts < 2 * num_slots:
        block_m *= 2
    return block_m


def choose(num_slots: int, num_experts: int, cc: int | None = None) -> MoeConfig:
    """Config for ``num_slots`` (= T * top_k) token slots over ``num_experts`` experts."""
    e = TABLE.get(compute_capability() if cc is None else cc, DEFAULT)
    block_m = block_m_for(num_slots, num_experts, e.max_block_m)
    if block_m <= 32:
        return MoeConfig(block_m, e.stream_gate_up, e.stream_down)
    return MoeConfig(block_m, e.compute_gate_up, e.compute_down)
