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
   ``floor(SMs / programs)`` (:func:`pallas_kernels._triton.sm_count`) so the grid is one full
   wave, and capped so the float32 partials (written, then read by the merge) stay below the
   gathered bytes (``S*H*Dv*4 <= K*D*itemsize`` per query, ``K *`` :meth:`Fp8Rows.row_bytes` for
   FP8 latent rows: 656 for GLM's 512 + 64, 583 for DeepSeek-V4's 448 + 64) or
   below ``PARTIAL_FLOOR_BYTES`` in all, an amount every target's L2 holds (small batches, where
   latency and not bandwidth decides).
3. If even the maximal split count cannot fill one wave (B = 1 with many heads), the head block
   is halved: more, smaller programs re-read the same rows from L2, which is cheaper than the
   latency of a few programs walking long index lists.
4. The gather step ``block_n`` is the table's, 64 rows for 64-head blocks on sm_90 (measured on
   H100, bf16: 129 vs 210 us at H = 64 B = 32, 2.86 vs 3.90 ms at prefill H = 128 T = 1024, 5.56
   vs 7.38 ms at prefill H = 64 T = 4096); 16-head blocks keep 32 (equal within noise at H = 16
   B = 1: 28.7 vs 27.7 us).
5. The tile then has to fit the shared memory (:func:`smem_bytes`, at the operand itemsize, so
   float32 gets smaller tiles than bf16): ``block_n`` is halved first (measured: 64 heads x 16
   rows beats 32 heads x 32 rows by 1.2x at prefill), then the stages, then the head block.
   128-head blocks never fit: the epilogue alone converts a 256 KiB float32 accumulator (and
   ptxas runs out of registers at 16 warps); both failed on H100.

``TUNED`` holds exact per-shape winners from ``benchmarks/kernels_mla.py`` sweeps (bf16, 576-wide
rows, K = 2048); it overrides the rule for that (compute capability, H, T) with 2-byte operands
when it fits. Hopper's 227 KiB hold a 64-head q tile (72 KiB) plus two stages of 64 gathered rows
(2 x 72 KiB) in bf16; A100 (163 KiB, mma.sync keeps q in registers next to the accumulator) stops
at 32 heads and 32-row steps; the consumer parts (sm_86/89/120/121, 99 KiB) use 32 heads and
16-row steps. sm_100 keeps 32-row steps until measured. Eight warps everywhere: at 32 heads that
is 64 accumulator + 32 q registers per thread, where four warps would spill (four warps measured
1.1-4.1x slower on H100).

FP8 latent rows (bf16 queries) take the same rule and ``TUNED`` entries, measured with bf16 rows,
wherever they fit: the grid-filling argument is the same and the dot operands are the same bf16
tiles. Their estimate (:func:`smem_bytes`) counts the staged bytes of the three parts, the decoded
value tile and one more scale group of it, calibrated on H200 with GLM's rows (DeepSeek-V4's, groups
of 64 and the rope part a value too, are estimated alike; their 64 heads x 64 rows x 2 stages built
there, ``kernels_mla_fp8-h200-v4flash.md``): GLM's 64 heads x 64 rows x 2 stages requested 239,872
bytes (estimate 240,128; budget 232,448) and failed, 1 stage built. When they do not fit, FP8 rows
drop stages before the gather step (``_FP8_KNOBS``): the tiles that pass through the decode are not
multi-buffered (3 stages requested only 768 bytes more than 2), and at 64 heads
64 rows x 1 stage beat 32 rows x 2 / 3 stages (H200, 64k context: 363 vs 422 / 409 us at B = 128,
112 vs 124 / 114 us at B = 32; ``benchmarks/results/kernels_mla_fp8-h200-b12e627.md``, profile).
Then :func:`fp8_adjust` sets warps and the hand-pipelined FP8 loop (``prefetch``) from the head
block and the grid (``FP8_TUNED``'s comment; H200 sweep in ``kernels_mla_fp8-h200.md``).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import (
    compute_capability,
    shared_memory_budget,
    shared_memory_bytes,
    shrink_to_fit,
    sm_count,
    tile_pad,
)
from pallas_kernels.quant import kv_fp8


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    block_h: int  # heads per program (power of two, >= 16)
    block_n: int  # gathered rows per loop step (power of two, >= 16)
    num_warps: int
    num_stages: int
    splits: int  # K splits per query (1 = no merge)
    # carry the next step's indices through the loop (A/B in benchmarks/kernels_mla.py); FP8 rows
    # also carry the next step's raw gathered parts (codes, scales, rope), loaded a step ahead
    prefetch: bool = False
    narrow_partials: bool = False  # K-split partial outputs in the query dtype, not float32 (A/B as above)


@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """FP8 latent rows as the kernel reads them (:func:`pallas_kernels.sparse_mla.ref.check_kv`):
    ``nope`` e4m3 columns, one scale of ``scale_bytes`` bytes per ``tile`` of them (float32: 4,
    ue8m0: 1), then the bf16 rope part."""

    nope: int
    tile: int
    scale_bytes: int

    @classmethod
    def ds_mla(cls, nope: int) -> Fp8Rows:
        """GLM's rows (``kv_fp8.DS_MLA``): float32 scales per 128 values."""
        return cls(nope, kv_fp8.TILE, 4)

    @property
    def nope_pad(self) -> int:
        """Columns the e4m3 part takes in the kernel: each scale group padded to a power of two."""
        return self.nope // self.tile * tile_pad(self.tile)

    def row_bytes(self, d_r: int) -> int:
        """Bytes one gathered row stages with a ``d_r``-wide rope part, padded as the kernel pads it
        (656 at GLM's 512 + 64, 583 at DeepSeek-V4's 448 + 64)."""
        return self.nope + self.nope // self.tile * self.scale_bytes + 2 * (tile_pad(d_r) if d_r else 0)


@dataclasses.dataclass(frozen=True)
class _Entry:
    max_block_h: int
    block_n: int  # rows per step for head blocks below 64
    num_warps: int
    num_stages: int
    max_splits: int = 64
    wide_block_n: int | None = None  # rows per step for 64-head blocks (None: block_n)


TABLE: dict[int, _Entry] = {
    80: _Entry(max_block_h=32, block_n=32, num_warps=8, num_stages=2),
    86: _Entry(max_block_h=32, block_n=16, num_warps=8, num_stages=2),
    89: _Entry(max_block_h=32, block_n=16, num_warps=8, num_stages=2),
    90: _Entry(max_block_h=64, block_n=32, num_warps=8, num_stages=2, wide_block_n=64),
    100: _Entry(max_block_h=64, block_n=32, num_warps=8, num_stages=2),
    120: _Entry(max_block_h=32, block_n=16, num_warps=8, num_stages=2),
    121: _Entry(max_block_h=32, block_n=16, num_warps=8, num_stages=2),
}
# Unknown GPU: sized for the smallest shared memory (99 KiB) so it always compiles.
DEFAULT = _Entry(max_block_h=32, block_n=16, num_warps=8, num_stages=2)

PARTIAL_FLOOR_BYTES = 4 << 20

# (compute capability, H, T) -> measured best config with bf16 operands (H100, kernels_mla-sweep-h100*.md).
# The first three are what the rule gives (kept as measured pins); the others beat the rule.
TUNED: dict[tuple[int, int, int], MlaConfig] = {
    (90, 64, 32): MlaConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, splits=4),  # 129 vs 210 us
    (90, 128, 1024): MlaConfig(
        block_h=64, block_n=64, num_warps=8, num_stages=2, splits=1
    ),  # 2861 vs 3896 us
    (90, 64, 4096): MlaConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, splits=1),  # 5559 vs 7375 us
    # 128 programs of 16 heads leave a wave of 132 SMs under-filled; two splits give 256
    (90, 16, 128): MlaConfig(block_h=16, block_n=32, num_warps=8, num_stages=2, splits=2),  # 239 vs 331 us
    (90, 64, 1): MlaConfig(block_h=16, block_n=32, num_warps=8, num_stages=3, splits=32),  # 13.4 vs 21.6 us
    # 3 stages at 16 heads, B = 32 (kernels_mla-h100.md, 2026-11-23): 61.3 vs 66.4 us. 3 stages also won
    # at H = 128, B = 32 (110.4 vs 116.5 us), but that tile is over the shared-memory estimate.
    (90, 16, 32): MlaConfig(block_h=16, block_n=32, num_warps=8, num_stages=3, splits=4),
}

# FP8 latent rows (bf16 operands), on top of the rule / TUNED (H200 sweep, 64k context, K = 2048,
# kernels_mla_fp8-h200.md): the hand-pipelined loop (``prefetch``: the next step's raw rows in the
# loop carry) pays where one program per SM has to hide its own gathers and its registers allow it:
# head blocks up to 32 and a grid of at most one wave (H = 16 B = 32: 62 vs 83 us without; H = 64
# B = 8, 32 heads: 44 vs 54 us). 64-head blocks never prefetch (their 128 KiB float32 accumulator
# leaves no registers for the carry: 667 vs 360 us at B = 128, 171 vs 108 us at B = 32) and keep 8
# warps (4 warps: 545 / 152 us). 16-head grids of more than one wave (H = 16 B = 128: 256 programs)
# run 4 warps and no prefetch: two programs per SM hide each other's gathers (187 us; 4 warps with
# prefetch 254, 8 warps 285, 8 warps with prefetch 232, b12e627's 8 warps 306).
FP8_PREFETCH_MAX_BLOCK_H = 32
FP8_CROWDED_WARPS = 4  # warps of a <= 32-head FP8 program when the grid is over one wave
# (compute capability, H, T) -> measured best FP8 config (the sweep's winners); the adjusted rule
# gives the same configs, kept as measured pins.
FP8_TUNED: dict[tuple[int, int, int], MlaConfig] = {
    (90, 16, 128): MlaConfig(block_h=16, block_n=32, num_warps=4, num_stages=2, splits=2),  # 187 us
    (90, 16, 32): MlaConfig(16, 32, 8, 3, 4, prefetch=True),  # 62.4 us (bf16 rows: 59.6)
    (90, 64, 128): MlaConfig(block_h=64, block_n=64, num_warps=8, num_stages=1, splits=1),  # 360 us
    (90, 64, 32): MlaConfig(block_h=64, block_n=64, num_warps=8, num_stages=1, splits=4),  # 108 us
}


def fp8_adjust(cfg: MlaConfig, t: int, h: int, sms: int) -> MlaConfig:
    """The FP8 changes to a config of the rule / ``TUNED`` (above): prefetch for <= 32-head blocks
    in a one-wave grid, 4 warps and no prefetch for them in a larger grid, 64-head blocks as they are."""
    if cfg.block_h > FP8_PREFETCH_MAX_BLOCK_H:
        return dataclasses.replace(cfg, prefetch=False)
    if t * -(-h // cfg.block_h) * cfg.splits > sms:
        return dataclasses.replace(cfg, num_warps=FP8_CROWDED_WARPS, prefetch=False)
    return dataclasses.replace(cfg, prefetch=True)


# Shrink order when a tile does not fit: gather step, stages, head block.
_KNOBS = (("block_n", 16), ("num_stages", 1), ("block_h", 16))
# FP8 rows: stages first (module docstring).
_FP8_KNOBS = (("num_stages", 1), ("block_n", 16), ("block_h", 16))


def _fp8_rows(fp8: bool | Fp8Rows, d_v: int) -> Fp8Rows | None:
    """``fp8`` as :class:`Fp8Rows` (True: GLM's DS_MLA rows of ``d_v`` e4m3 columns), None for float rows."""
    if fp8 is True:
        return Fp8Rows.ds_mla(d_v)
    return fp8 or None


def smem_bytes(cfg: MlaConfig, *, d_v: int, d_r: int, itemsize: int, fp8: bool | Fp8Rows = False) -> int:
    """Shared-memory estimate (:func:`pallas_kernels._triton.shared_memory_bytes`) of one program:
    the q tile ``[block_h, Dv + Dr]`` resident, per stage ``block_n`` gathered rows plus their int32
    indices, the ``[block_h, Dv]`` float32 output tile in the epilogue (widths padded as the kernel
    pads them). ``d_v`` is the value (output) columns, ``d_r`` the rope part's; float rows are
    ``d_v + d_r`` wide. FP8 latent rows (``fp8``: :class:`Fp8Rows`, True for GLM's) are
    ``fp8.nope + d_r`` wide, with ``d_v`` either ``nope`` or the whole row (DeepSeek-V4: the rope part is
    a value group too); they stage :meth:`Fp8Rows.row_bytes` each and are decoded into a
    ``[block_n, nope + Dr]`` operand tile (the e4m3 part; the rope part too unless it is already the
    operand dtype, bf16) that stays resident for both dots, as the quantized matmuls count theirs
    (:func:`pallas_kernels.quant.tiles.decoded_tile_bytes`), plus one more scale group of it
    (layout-conversion scratch; calibrated on H200, module docstring)."""
    rows = _fp8_rows(fp8, d_v)
    r_pad = tile_pad(d_r) if d_r else 0
    if rows is None:
        v_pad = out_pad = tile_pad(d_v)
        row_bytes, decoded = (v_pad + r_pad) * itemsize, 0
    else:
        v_pad = rows.nope_pad
        out_pad = v_pad + (r_pad if d_v > rows.nope else 0)
        row_bytes = rows.row_bytes(d_r)
        decoded = cfg.block_n * (v_pad + tile_pad(rows.tile) + (r_pad if itemsize != 2 else 0)) * itemsize
    return shared_memory_bytes(
        resident=cfg.block_h * (v_pad + r_pad) * itemsize + decoded,
        stage=cfg.block_n * (row_bytes + 4),
        num_stages=cfg.num_stages,
        epilogue=cfg.block_h * out_pad * 4,
    )


def choose(
    t: int,
    h: int,
    k: int,
    *,
    d_v: int,
    d_r: int,
    itemsize: int,
    block_h: int | None = None,
    fp8: bool | Fp8Rows = False,
) -> MlaConfig:
    """Config for T queries, H heads, K indices per query, ``d_v`` value columns and a ``d_r``-wide
    rope part (:func:`smem_bytes`: float rows ``d_v + d_r`` wide) and dot operands of ``itemsize``
    bytes; ``fp8``: the rows are FP8 latent parts (:class:`Fp8Rows`; True: GLM's).

    ``block_h`` fixes the head block (benchmark sweeps) and leaves the rest to the rule.
    """
    cc = compute_capability()
    budget = shared_memory_budget(cc)
    nbytes = lambda c: smem_bytes(c, d_v=d_v, d_r=d_r, itemsize=itemsize, fp8=fp8)  # noqa: E731
    if fp8:
        fp8 = _fp8_rows(fp8, d_v)
        # measured on GLM's rows only
        glm = fp8 == Fp8Rows.ds_mla(d_v) and block_h is None and itemsize == 2
        tuned = FP8_TUNED.get((cc, h, t)) if glm else None
        if tuned and nbytes(tuned) <= budget:
            return tuned
        cfg = _choose(
            cc, budget, nbytes, t, h, k, d_v=d_v, d_r=d_r, itemsize=itemsize, block_h=block_h, fp8=fp8
        )
        return fp8_adjust(cfg, t, h, sm_count(cc))
    return _choose(cc, budget, nbytes, t, h, k, d_v=d_v, d_r=d_r, itemsize=itemsize, block_h=block_h)


def _choose(cc, budget, nbytes, t, h, k, *, d_v, d_r, itemsize, block_h, fp8=None) -> MlaConfig:
    """:func:`choose` before the FP8 adjustments (``fp8``: :class:`Fp8Rows` or None): ``TUNED``
    (2-byte operands), else the rule."""
    tuned = TUNED.get((cc, h, t)) if block_h is None and itemsize == 2 else None
    if tuned and nbytes(tuned) <= budget:  # measured at 576-wide rows; wider ones may not fit
        return tuned
    e = TABLE.get(cc, DEFAULT)
    gathered = fp8.row_bytes(d_r) if fp8 else (d_v + d_r) * itemsize  # bytes per row
    partial_budget = max(t * k * gathered, PARTIAL_FLOOR_BYTES)

    def block_n_for(block_h: int) -> int:
        wide = e.wide_block_n if block_h >= 64 and e.wide_block_n else e.block_n
        return min(wide, tile_pad(k))

    def max_splits(block_n: int) -> int:
        return max(1, min(e.max_splits, k // block_n, partial_budget // (t * h * 4 * d_v)))

    sms = sm_count(cc)
    if block_h is None:
        block_h = min(e.max_block_h, tile_pad(h))
        while block_h > 16 and t * -(-h // block_h) * max_splits(block_n_for(block_h)) < sms:
            block_h //= 2
    cfg = MlaConfig(block_h, block_n_for(block_h), e.num_warps, e.num_stages, splits=1)
    cfg = shrink_to_fit(cfg, nbytes, budget, _FP8_KNOBS if fp8 else _KNOBS)
    programs = t * -(-h // cfg.block_h)
    return dataclasses.replace(cfg, splits=max(1, min(max_splits(cfg.block_n), sms // programs)))
