"""Block sizes for the indexer-logits kernels, per GPU compute capability.

Two kernels (see ``kernel.py``): the *row* kernel (one query x ``block_s`` keys per program; decode)
and the *tile* kernel (``block_t`` queries x ``block_s`` keys per program, MMA over queries x keys,
loop over heads; prefill). Shared-memory use of the tile kernel is about
``num_stages * block_t * 128 * 2 + block_s * 128 * 2`` bytes, so the 99 KiB parts (sm_86, sm_89,
sm_12x) get two stages; A100 (163 KiB) and H100 (227 KiB) three. Values are starting points until
``benchmarks/kernels_indexer.py`` has been run on each part; it prints the best variant per shape.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import pltriton


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Row kernel: one query, ``steps`` blocks of ``block_s`` keys per program, one
    ``[block_s, D] x [D, Hi]`` dot per block. With ``steps > 1`` and ``num_stages > 1`` Triton
    pipelines the loop, prefetching the next block's page-table and key gathers."""

    block_s: int = 128
    num_warps: int = 4
    num_stages: int = 1
    steps: int = 1


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile kernel: ``block_t`` queries x ``block_s`` keys, one ``[block_s, D] x [D, block_t]`` dot per head."""

    block_t: int = 64
    block_s: int = 128
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    row: RowConfig = RowConfig()
    tile: TileConfig = TileConfig()
    # The paged form uses the tile kernel when queries outnumber sequences by this factor
    # (prefill); otherwise the row kernel (decode, where every query has its own keys).
    tile_min_queries_per_seq: int = 2


_SMALL_SMEM = IndexerConfig(tile=TileConfig(block_t=64, block_s=128, num_warps=4, num_stages=2))

TABLE: dict[int, IndexerConfig] = {
    80: IndexerConfig(tile=TileConfig(block_t=64, block_s=128, num_warps=4, num_stages=3)),
    86: _SMALL_SMEM,
    89: _SMALL_SMEM,
    90: IndexerConfig(
        row=RowConfig(block_s=128, num_warps=4),
        tile=TileConfig(block_t=64, block_s=128, num_warps=4, num_stages=3),
    ),
    100: IndexerConfig(tile=TileConfig(block_t=64, block_s=128, num_warps=4, num_stages=3)),
    120: _SMALL_SMEM,
    121: _SMALL_SMEM,
}
DEFAULT = _SMALL_SMEM


def target_compute_capability() -> int:
    """Compute capability being lowered for: the abstract device of a deviceless lowering, else the
    local GPU; 0 without either (CPU interpret runs)."""
    if pltriton is None:
        return 0
    try:
        return pltriton.get_gpu_info().compute_capability
    except ValueError:  # no GPU: "Unsupported GPU device kind: cpu"
        return 0


def config_for(cc: int | None = None) -> IndexerConfig:
    """The table entry for ``cc`` (default: the current target); unknown parts get ``DEFAULT``."""
    return TABLE.get(target_compute_capability() if cc is None else cc, DEFAULT)
