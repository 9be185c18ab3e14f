"""Block sizes, warps, stages and K splits for the sparse-MLA kernel, per GPU compute capability.

One program owns ``block_h`` heads of one query and one contiguous chunk (a "split") of that
query's index list; it gathers ``block_n`` rows per loop step. The choice per shape:

1. ``block_h`` = all heads (padded to 16, the MMA minimum) up to the table's ``max_block_h``.
   Every gathered row is then read once per query (per head group above ``max_block_h``).
   ``max_block_h`` is set by registers: the f32 accumulator ``[block_h, 512]`` is 128 KiB at
   64 heads, i.e. 128 registers per thread at 8 warps. H = 128 therefore runs as two 64-head
   groups on neighbouring programs (head group is the fastest grid axis, so both groups of a
   query are co-resident and the second read of each row comes from L2, not HBM).
2. Splits fill the GPU when few (query, head group) programs exist (decode): the K axis is cut
   into ``splits`` chunks whose partial states are LSE-merged. Splits are chosen as
   ``floor(num_sms / programs)`` so the grid is one full wave, and capped so the float32 partials
   (written, then read by the merge) stay below the gathered bytes (``S*H*Dv*4 <= K*D*itemsize``
   per query) or below ``PARTIAL_FLOOR_BYTES`` in all, an amount every target's L2 holds (small
   batches, where latency and not bandwidth decides).
3. If even the maximal split count cannot fill one wave (B = 1 with many heads), the head block
   is halved: more, smaller programs re-read the same rows from L2, which is cheaper than the
   latency of a few programs walking long index lists.

``TUNED`` holds exact per-shape winners from ``benchmarks/kernels_mla.py`` sweeps; it overrides
the rule for that (compute capability, H, T). The table below is a reasoned starting point, not
yet measured: Hopper / datacenter Blackwell have ~227 KiB of shared memory (64-head q tile 72 KiB
+ two stages of 32 gathered rows 72 KiB) and wgmma reads q from shared memory; A100 (163 KiB,
mma.sync keeps q in registers next to the accumulator) stops at 32 heads; the consumer parts
(sm_86/89/120/121, 99 KiB) use 32 heads and 16-row steps. Eight warps everywhere: at 32 heads
that is 64 accumulator + 32 q registers per thread, where four warps would spill.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import compute_capability


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    block_h: int  # heads per program (power of two, >= 16)
    block_n: int  # gathered rows per loop step (power of two, >= 16)
    num_warps: int
    num_stages: int
    splits: int  # K splits per query (1 = no merge)


@dataclasses.dataclass(frozen=True)
class _Entry:
    num_sms: int
    max_block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    max_splits: int = 64


TABLE: dict[int, _Entry] = {
    80: _Entry(num_sms=108, max_block_h=32, block_n=32, num_warps=8, num_stages=2),
    86: _Entry(num_sms=84, max_block_h=32, block_n=16, num_warps=8, num_stages=2),
    89: _Entry(num_sms=128, max_block_h=32, block_n=16, num_warps=8, num_stages=2),
    90: _Entry(num_sms=132, max_block_h=64, block_n=32, num_warps=8, num_stages=2),
    100: _Entry(num_sms=148, max_block_h=64, block_n=32, num_warps=8, num_stages=2),
    120: _Entry(num_sms=188, max_block_h=32, block_n=16, num_warps=8, num_stages=2),
    121: _Entry(num_sms=48, max_block_h=32, block_n=16, num_warps=8, num_stages=2),
}
# Unknown GPU: sized for the smallest shared memory (99 KiB) so it always compiles.
DEFAULT = _Entry(num_sms=108, max_block_h=32, block_n=16, num_warps=8, num_stages=2)

PARTIAL_FLOOR_BYTES = 4 << 20

# (compute capability, H, T) -> measured best config; filled from benchmark sweeps.
TUNED: dict[tuple[int, int, int], MlaConfig] = {}


def _pow2_at_least(x: int, floor: int) -> int:
    p = floor
    while p < x:
        p *= 2
    return p


def choose(
    t: int, h: int, k: int, row_bytes: int, partial_row_bytes: int, *, block_h: int | None = None
) -> MlaConfig:
    """Config for T queries, H heads, K indices per query.

    ``row_bytes``: bytes of one gathered kv row; ``partial_row_bytes``: bytes of one head's
    float32 partial output (4 * v_dim). Both only cap the number of splits. ``block_h`` fixes the
    head block (benchmark sweeps) and leaves only the split count to the rule.
    """
    cc = compute_capability()
    if block_h is None and (cc, h, t) in TUNED:
        return TUNED[(cc, h, t)]
    e = TABLE.get(cc, DEFAULT)
    block_n = min(e.block_n, _pow2_at_least(k, 16))
    partial_budget = max(t * k * row_bytes, PARTIAL_FLOOR_BYTES)
    max_splits = max(1, min(e.max_splits, k // block_n, partial_budget // (t * h * partial_row_bytes)))
    if block_h is None:
        block_h = min(e.max_block_h, _pow2_at_least(h, 16))
        while block_h > 16 and t * -(-h // block_h) * max_splits < e.num_sms:
            block_h //= 2
    programs = t * -(-h // block_h)
    splits = max(1, min(max_splits, e.num_sms // programs))
    return MlaConfig(block_h, block_n, e.num_warps, e.num_stages, splits)
