"""Chunk sizes for the top-k select kernel, per GPU compute capability.

One program holds a chunk of ``chunk`` keys in registers, ``elems_per_thread`` per thread
(so ``num_warps = chunk / (32 * elems_per_thread)``, at most 16). Bigger chunks mean fewer
candidate stages on long rows (each stage shrinks a row by ``chunk / k``) but fewer programs per
row and more registers per thread. Every listed part has 64 K registers per SM, so one table
fits all until ``benchmarks/kernels_indexer.py`` has been run on each; it prints the best variant
per shape.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import compute_capability

MAX_WARPS = 16
SEARCHES = ("bisect", "secant")


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    chunk: int = 8192
    elems_per_thread: int = 32
    # How a program finds its cutoff: "bisect" (MSB-first on the key bits, <= 32 counts; 19 on
    # normal rows of 8192) or "secant" (false position on the values, Illinois-weighted, with a
    # bisection step after two slow ones: 10.5 counts on normal rows, 25 mean and 80 worst on rows
    # of 50 distinct values; `python -m benchmarks.topk_probes`). Each count is a block reduction,
    # the top-k kernel's bottleneck on H100. Untimed on a GPU so far, so the table keeps "bisect".
    search: str = "bisect"

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:  # the kernel would otherwise fall back to bisection silently
            raise ValueError(f"TopkConfig.search {self.search!r}: choose one of {SEARCHES}")

    def num_warps(self, chunk: int) -> int:
        """Warps for a program holding ``chunk`` keys (a final stage may use a smaller chunk)."""
        return max(1, min(MAX_WARPS, chunk // (32 * self.elems_per_thread)))


TABLE: dict[int, TopkConfig] = {
    80: TopkConfig(chunk=8192, elems_per_thread=32),
    86: TopkConfig(chunk=8192, elems_per_thread=32),
    89: TopkConfig(chunk=8192, elems_per_thread=32),
    90: TopkConfig(chunk=8192, elems_per_thread=32),
    100: TopkConfig(chunk=8192, elems_per_thread=32),
    120: TopkConfig(chunk=8192, elems_per_thread=32),
    121: TopkConfig(chunk=8192, elems_per_thread=32),
}
DEFAULT = TopkConfig()


def config_for(cc: int | None = None) -> TopkConfig:
    """The table entry for ``cc`` (default: the current target); unknown parts get ``DEFAULT``."""
    return TABLE.get(compute_capability() if cc is None else cc, DEFAULT)
