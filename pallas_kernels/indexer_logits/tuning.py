"""Block sizes for the indexer-logits kernels, per GPU compute capability.

Two kernels (see ``kernel.py``): the *row* kernel (one query x ``block_s`` keys per program; decode)
and the *tile* kernel (``block_t`` queries x ``block_s`` keys per program, MMA over queries x keys,
loop over heads; prefill). The 99 KiB parts (sm_86, sm_89, sm_12x) get two tile stages; A100
(163 KiB) and H100 (227 KiB) three. On H100 (bf16, ``benchmarks/results/kernels_indexer-h100.md``)
the tile config was the fastest at every prefill shape. For decode, H100 takes four pipelined
128-key steps per program (three stages): with dispatch-overlapped timing it beat the single step
at all five decode shapes measured (35.5 vs 44.3 us at 32 heads x 8k keys, 412 vs 434 us at 128k;
``benchmarks/results/kernels-h100.md``), where synchronous timing had called them even.

:func:`choose` fits the table's configs to the shared memory for the actual head count and
operand itemsize (:func:`smem_bytes`): float32 operands double every tile, and the MMA pads the
heads of the row kernel to 16.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import (
    compute_capability,
    shared_memory_budget,
    shared_memory_bytes,
    shrink_to_fit,
    tile_pad,
)


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
    """Tile kernel: ``block_t`` queries x ``block_s`` keys, one ``[block_s, D] x [D, block_t]`` dot
    per head."""

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
        row=RowConfig(block_s=128, num_warps=4, num_stages=3, steps=4),
        tile=TileConfig(block_t=64, block_s=128, num_warps=4, num_stages=3),
    ),
    100: IndexerConfig(tile=TileConfig(block_t=64, block_s=128, num_warps=4, num_stages=3)),
    120: _SMALL_SMEM,
    121: _SMALL_SMEM,
}
DEFAULT = _SMALL_SMEM


def config_for(cc: int | None = None) -> IndexerConfig:
    """The table entry for ``cc`` (default: the current target); unknown parts get ``DEFAULT``."""
    return TABLE.get(compute_capability() if cc is None else cc, DEFAULT)


# Shrink order when a config does not fit: stages (down to 2), keys, queries, the last stage.
_ROW_KNOBS = (("num_stages", 2), ("block_s", 16), ("num_stages", 1))
_TILE_KNOBS = (("num_stages", 2), ("block_s", 16), ("block_t", 16), ("num_stages", 1))


def smem_bytes(cfg: RowConfig | TileConfig, *, num_heads: int, head_dim: int, itemsize: int) -> int:
    """Shared-memory estimate (:func:`pallas_kernels._triton.shared_memory_bytes`) of one program.

    Row kernel: the query's ``[heads, D]`` tile (heads padded to 16) and weights resident; per stage
    ``block_s`` gathered keys with their page-table entry and fp8 scale. Tile kernel: the
    ``[block_s, D]`` key tile resident; per stage one head's ``[block_t, D]`` queries and weights;
    the ``[block_t, block_s]`` float32 logits in the epilogue; and, since tiles that span several
    sequences run the row path inside the same kernel, at least the row estimate at its sizes.
    """
    row_width = head_dim * itemsize
    heads = tile_pad(num_heads)
    row = shared_memory_bytes(
        resident=heads * (row_width + 4), stage=cfg.block_s * (row_width + 8), num_stages=cfg.num_stages
    )
    if isinstance(cfg, RowConfig):
        return row
    tile = shared_memory_bytes(
        resident=cfg.block_s * (row_width + 8),
        stage=cfg.block_t * (row_width + 4),
        num_stages=cfg.num_stages,
        epilogue=cfg.block_s * cfg.block_t * 4,
    )
    return max(row, tile)


def choose(*, num_heads: int, head_dim: int, itemsize: int, cc: int | None = None) -> IndexerConfig:
    """The table entry for ``cc`` (default: the current target), fitted to its shared memory for
    ``num_heads`` heads of ``head_dim`` and ``itemsize``-byte operands."""
    cc = compute_capability() if cc is None else cc
    e = config_for(cc)
    budget = shared_memory_budget(cc)
    nbytes = lambda c: smem_bytes(c, num_heads=num_heads, head_dim=head_dim, itemsize=itemsize)  # noqa: E731
    row = shrink_to_fit(e.row, nbytes, budget, _ROW_KNOBS)
    return dataclasses.replace(e, row=row, tile=shrink_to_fit(e.tile, nbytes, budget, _TILE_KNOBS))
