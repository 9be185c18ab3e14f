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

from pallas_kernels._triton import compute_capability, sm_count

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
    # the top-k kernel's bottleneck on H100.
    search: str = "bisect"

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:  # the kernel would otherwise fall back to bisection silently
            raise ValueError(f"TopkConfig.search {self.search!r}: choose one of {SEARCHES}")

    def num_warps(self, chunk: int) -> int:
        """Warps for a program holding ``chunk`` keys (a final stage may use a smaller chunk)."""
        return max(1, min(MAX_WARPS, chunk // (32 * self.elems_per_thread)))


@dataclasses.dataclass(frozen=True)
class Entry:
    """A part's configs: ``large`` unless its first stage would run fewer programs than the part
    has SMs (``rows * ceil(keys / large.chunk) < sms``, :func:`pallas_kernels._triton.sm_count`),
    where ``small`` keeps more of them busy; ``single`` (if set) for rows that fit one of its chunks
    when there are at least ``sms`` rows."""

    small: TopkConfig
    large: TopkConfig
    single: TopkConfig | None = None


_BASE = TopkConfig(chunk=8192, elems_per_thread=32)
TABLE: dict[int, Entry] = {
    80: Entry(_BASE, _BASE),
    86: Entry(_BASE, _BASE),
    89: Entry(_BASE, _BASE),
    # H100 (benchmarks/results/topk-sweep-h100.md): 16384-key chunks at 16 warps won every shape
    # with at least 132 first-stage programs ([4096, 32768]: 1645 vs 2150 us; [32, 131072]: 79 vs
    # 94 us); below that 8192-key chunks at 16 warps ([32, 32768]: 31.8 vs 35.0 us); one chunk per
    # row with the secant search on many short rows ([4096, 8192]: 219 vs 266 us).
    90: Entry(
        small=TopkConfig(chunk=8192, elems_per_thread=16),
        large=TopkConfig(chunk=16384, elems_per_thread=32),
        single=TopkConfig(chunk=8192, elems_per_thread=32, search="secant"),
    ),
    100: Entry(_BASE, _BASE),
    120: Entry(_BASE, _BASE),
    121: Entry(_BASE, _BASE),
}
DEFAULT = Entry(TopkConfig(), TopkConfig())


def config_for(cc: int | None = None, *, rows: int | None = None, keys: int | None = None) -> TopkConfig:
    """The table's config for ``cc`` (default: the current target) and a ``[rows, keys]`` input
    (unknown shape: the ``large`` config); unknown parts get ``DEFAULT``."""
    cc = compute_capability() if cc is None else cc
    e = TABLE.get(cc, DEFAULT)
    if rows is None or keys is None:
        return e.large
    sms = sm_count(cc)
    if e.single is not None and keys <= e.single.chunk and rows >= sms:
        return e.single
    return e.large if rows * -(-keys // e.large.chunk) >= sms else e.small
