"""Tile sizes, warps and stages for the MoE expert kernels, per GPU compute capability.

Both kernels run one program per (block of ``block_m`` token slots of one expert, output tile),
so ``block_m`` decides how often an expert's weights are streamed: once per block. It is picked
from the mean number of slots per expert, ``S / E``, as the smallest power of two >= ``2 S / E``
(16 at least, the MMA minimum): decode-sized batches (GLM-5: T <= 256 at top-8 of 256 experts,
at most 8 slots per expert on average) get 16-row blocks that almost always hold all of an
expert's slots, so every touched expert is read once and the kernels are pure weight streams
(the rare second block of an expert runs next to the first and reads the weights from L2).
Larger batches grow the block up to the table's ``max_block_m``. On H100 128-row blocks win at
T = 4096 (~128 slots per expert): 7.3 vs 8.9 ms for 64-row blocks, whose extra programs re-read
every weight tile. Partly filled blocks multiply only their rows (down to ``min_block_m``) and
an expert's last block of at most ``absorb_m`` rows rides on the block before it
(:mod:`.kernel`); on H200, where T = 4096 is bound by tensor work, shrinking alone gave
7.0 vs 7.5 ms.

Three tile sets per GPU, each a (gate|up, down) pair:

* ``few``: fewer slots than experts (``S < E``; T <= 31 at top-8 of 256): few experts are touched
  and the grid is small. On H100 the wide ``128 x 64`` tiles beat ``64 x 128`` at T = 1 and 8
  too (211 vs 217 us, 1488 vs 1528 us);
* ``stream`` (``block_m <= 32``): weight bandwidth. On H100 wide ``128 x 64`` tiles (128
  contiguous output columns per weight row) beat ``64 x 128`` by 3.6-4.7 % at T = 32, 128 and 512;
* ``compute`` (``block_m >= 64``): tensor-core tiles; on H100 at T = 4096, 128 x 64 tiles with
  8 warps, 4 stages for gate|up (3 for down, which keeps two programs per SM).

4-bit experts (INT4 / FP4) decode in the K loop, and at 4 warps that arithmetic bounds the few /
stream kernels on H100: they run 8 warps there (``warps_4bit``; 1.9-2.2x at T = 1 / 8 / 32), and 3
stages (``stages_4bit``): INT4 in words 638 / 1590 / 2530 us at T = 8 / 32 / 128 against 716 / 1756
/ 2766 with 4, equal at T = 1 and 512 (2 stages: 10-18 % slower), and Triton compiles the layer in
11 s instead of 20 (``benchmarks/results/compile_time-h100-words.md``). In 64- and 128-row
blocks a 4-bit weight pass costs about as much as four passes of the 32-row stream kernels (INT4
in words: 12.4 ms at T = 2048 in 128-row blocks, one pass, against 8.4 ms in 32-row blocks, two
passes; 15.0 ms in 64-row blocks) and compiles for 96-170 s instead of 22-49: Triton multiplies
there with Hopper's warpgroup MMA and decodes into shared memory for it, 11.4 instructions per
weight against 4.1 (``profile-h100-moe-int4-words-t4096.md``). So 4-bit experts keep 32-row
blocks and the stream tiles up to 64 slots per expert on average (``stream_4bit_slots``; T = 2048
at top-8 of 256), where four passes catch up with one (T = 4096: 15.3 ms against 13.0;
``benchmarks/results/quant-h100-int4-block-m.md``).

Swept at decode by each kernel's traced time (``benchmarks/moe_tiles.py``; GLM-5.2's routed experts
at TP 4 on H100, INT4, ``benchmarks/results/moe_tiles-h100-glm52-tp4.md``), the table's 4-bit tiles
stand: at T = 1 gate|up 19.1 and down 13.4 us (40 % of the read ceiling with the routing, SwiGLU and
combine kernels, 6.8 us more per call); 4 warps 1.8-2.2x slower, 2 or 4 stages, 2 or 8 K splits and
64- or 256-column tiles 7-23 % slower, a 64-column down tile at 4 warps within 4 % (12.9 us at T = 1,
70 against 68 at T = 8).

Decode batches of quantized experts split the gate|up kernel over K when its grid would not fill
the GPU (``splits``, :func:`k_splits`): one token at top-8 meets 8 experts, and at TP 4 an expert's
1024 gate|up columns are 4 tiles of 128, 32 programs for 132 SMs. Split 4 ways (float32 partial
sums, then added and activated in one XLA fusion) the routed experts of one token took 45 vs 89
us (INT4) and 56 vs 132 us (FP4) on H100 at GLM-5's TP-4 widths; at T = 8 (256 programs already)
splits gained nothing (``benchmarks/results/quant-h100-tp4-splits.md``). The rule is the grid's, so
every part takes it with its own SM count. The down kernel adding the partial sums itself as it
loads its activation tiles (no launch between the kernels) measured slower: GLM-5.2 INT4 at 78
layers, TP 4 on 4 x H200, went from 11.97 to 16.06 ms a decode step, ``moe_down`` from 15 to 46 us
(its 4-bit tile lost a pipeline stage to the partial sums, and every D tile re-read them). The
partial sums are added by a kernel of their own that reads only the blocks' filled rows: XLA's
fusion read the block map's worst case, 16 tokens at TP 2 4 x 2,304 rows x 2,048 float32 columns,
75 MB in 19.5 us a layer on an H200. Counting those bytes in the split rule instead (no split at
16 tokens) measured worse on the GPU: ``moe_gate_up`` unsplit took 113 against 79 us, the step's
GPU time 10.37 / 10.44 against 9.96 / 9.93 ms at 32 layers, 2 x H200
(``decode_anatomy-h200-h200x2-glm52-int4-tp2-32l-s16-{splits,splits2,before,before2}.md``).

sm_100 and the other parts keep their reasoned starting points (one tile set for ``few`` and
``stream``) until ``benchmarks/moe.py`` has been run on them. Every choice is then fitted to the
shared memory at the operand itemsize (:func:`smem_bytes`), so float32 gets fewer stages or
smaller tiles than bf16: stages shrink first (3 and 4 stages measured equal on H100), then the K
step, then the N tile.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import (
    compute_capability,
    shared_memory_budget,
    shared_memory_bytes,
    shrink_to_fit,
    sm_count,
)
from pallas_kernels.quant.tiles import decoded_tile_bytes


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
    min_block_m: int = 16  # smallest row tile a partly filled block shrinks to (block_m: never)
    absorb_m: int = 16  # an expert's last block with <= this many rows rides on the block before (0: never)
    splits: int = 1  # K splits of the gate|up kernel (partial sums added by a kernel before the SwiGLU)


Tiles = tuple[Tile, Tile]  # (gate|up, down)


@dataclasses.dataclass(frozen=True)
class _Entry:
    few: Tiles
    stream: Tiles
    compute: Tiles
    max_block_m: int = 64
    warps_4bit: int | None = None  # few / stream tiles with 4-bit weights: warps (None: as the tiles)
    stages_4bit: int | None = None  # ... and stages (None: as the tiles)
    # 4-bit weights keep 32-row blocks and the stream tiles until the mean slots per expert pass
    # this (None: the block rule alone)
    stream_4bit_slots: int | None = None


# Tiles as Tile(block_n, block_k, num_warps, num_stages).
_H100 = _Entry(  # measured: benchmarks/results/moe-h100*.md
    few=(Tile(128, 64, 4, 4), Tile(128, 64, 4, 4)),
    stream=(Tile(128, 64, 4, 4), Tile(128, 64, 4, 4)),
    compute=(Tile(128, 64, 8, 4), Tile(128, 64, 8, 3)),
    max_block_m=128,
    # INT4 experts decode in the K loop and are bound by that arithmetic at 4 warps: 8 warps took
    # 134 / 839 / 2072 us at T = 1 / 8 / 32 against 261 / 1840 / 4629 (bf16 INT4 arithmetic)
    warps_4bit=8,
    stages_4bit=3,  # quant-h100-stages.md: 8-11 % faster at T = 8-128 than 4, and a 1.8x faster compile
    stream_4bit_slots=64,  # quant-h100-int4-block-m.md: T = 2048 8.4 vs 12.4 ms; T = 4096 15.3 vs 13.0
)
_BIG_SMEM = _Entry(  # sm_100: ~227 KiB
    few=(Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
    stream=(Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
    compute=(Tile(128, 64, 8, 3), Tile(128, 64, 4, 4)),
)
_A100 = _Entry(  # 163 KiB
    few=(Tile(64, 128, 4, 3), Tile(64, 128, 4, 4)),
    stream=(Tile(64, 128, 4, 3), Tile(64, 128, 4, 4)),
    compute=(Tile(128, 64, 8, 3), Tile(128, 64, 4, 4)),
)
_SMALL_SMEM = _Entry(  # 99 KiB consumer parts
    few=(Tile(64, 64, 4, 4), Tile(64, 128, 4, 3)),
    stream=(Tile(64, 64, 4, 4), Tile(64, 128, 4, 3)),
    compute=(Tile(64, 64, 4, 3), Tile(128, 64, 4, 3)),
)

TABLE: dict[int, _Entry] = {
    80: _A100,
    86: _SMALL_SMEM,
    89: _SMALL_SMEM,
    90: _H100,
    100: _BIG_SMEM,
    120: _SMALL_SMEM,
    121: _SMALL_SMEM,
}
# Unknown GPU (and the CPU interpreter): sized for the smallest shared memory so it compiles.
DEFAULT = _SMALL_SMEM

# Shrink order when a tile does not fit: stages (down to 2), K step, N tile, the last stage.
_KNOBS = (("num_stages", 2), ("block_k", 16), ("block_n", 16), ("num_stages", 1))
_KNOBS_4BIT = (("num_stages", 2), ("block_k", 64), ("block_n", 16), ("num_stages", 1))  # whole packed chunks


MAX_SPLITS = 4


def k_splits(num_slots: int, num_experts: int, n_out: int | None, block_n: int, sms: int) -> int:
    """gate|up K splits for a batch with fewer slots than experts: the split count (up to
    MAX_SPLITS) whose grid (about one block per slot, times the N tiles, times the splits) finishes
    soonest in waves of one program per SM: ``ceil(programs / sms) / splits`` of one unsplit
    program's time, the fewest splits among equals.

    Waves, not a power of two that fits one: a 4-bit tile at 8 warps holds a whole SM's registers,
    so a program past the wave runs after it. One token at top-8 + 1 (a shared expert routed as one
    more, :mod:`jaxdsa.shared_experts`) of GLM-5.2 at TP 4 is 36 programs: 4 splits are 144
    programs in two waves (H100: 31.7 against 19.2 us for the routed 8 in one), 3 splits 108 in one."""
    if n_out is None or num_slots >= num_experts:
        return 1
    programs = num_slots * max(n_out // block_n, 1)
    return min(range(1, MAX_SPLITS + 1), key=lambda s: (-(-programs * s // sms) / s, s))


def block_m_for(num_slots: int, num_experts: int, max_block_m: int) -> int:
    """Smallest power of two >= 2 * mean slots per expert, clamped to [16, max_block_m]."""
    block_m = 16
    while block_m < max_block_m and block_m * num_experts < 2 * num_slots:
        block_m *= 2
    return block_m


def smem_bytes(
    tile: Tile, *, block_m: int, weight_tiles: int, itemsize: int, weight_bits: int | None = None
) -> int:
    """Shared-memory estimate (:func:`pallas_kernels._triton.shared_memory_bytes`) of one program:
    per stage the ``[block_m, block_k]`` activation tile and ``weight_tiles`` (2 for gate|up, 1 for
    down) ``[block_k, block_n]`` weight tiles; the ``[block_m, block_n]`` output in the epilogue.
    Quantized weights (``weight_bits``) load their codes per stage, and their dequantized tiles stay
    resident as :func:`pallas_kernels.quant.tiles.decoded_tile_bytes` says."""
    weight = weight_tiles * tile.block_n * tile.block_k
    if weight_bits is None:
        stage, resident = (block_m * tile.block_k + weight) * itemsize, 0
    else:
        stage = block_m * tile.block_k * itemsize + weight * weight_bits // 8
        resident = decoded_tile_bytes(weight, block_m=block_m, itemsize=itemsize, weight_bits=weight_bits)
    return shared_memory_bytes(
        stage=stage, num_stages=tile.num_stages, resident=resident, epilogue=block_m * tile.block_n * 4
    )


def choose(
    num_slots: int,
    num_experts: int,
    *,
    itemsize: int,
    cc: int | None = None,
    weight_bits: int | None = None,
    kpack: int = 0,
    n_out: int | None = None,
) -> MoeConfig:
    """Config for ``num_slots`` (= T * top_k) token slots over ``num_experts`` experts with
    ``itemsize``-byte activations (and weights, when dense). Quantized experts (``weight_bits`` 8 or
    4) take the same tiles, 4-bit ones with twice the K step (the same bytes per load) and at least
    one packed chunk (``kpack`` rows), shrunk to fit with their own estimate; with ``n_out`` (each
    expert's gate|up columns, N) their decode batches split gate|up over K (:func:`k_splits`)."""
    cc = compute_capability() if cc is None else cc
    e = TABLE.get(cc, DEFAULT)
    block_m = block_m_for(num_slots, num_experts, e.max_block_m)
    if weight_bits == 4 and e.stream_4bit_slots and num_slots <= e.stream_4bit_slots * num_experts:
        block_m = min(block_m, 32)
    gate_up, down = e.few if num_slots < num_experts else e.stream if block_m <= 32 else e.compute
    if weight_bits == 4 and block_m <= 32:
        gate_up, down = (
            dataclasses.replace(
                tile, num_warps=e.warps_4bit or tile.num_warps, num_stages=e.stages_4bit or tile.num_stages
            )
            for tile in (gate_up, down)
        )
    budget = shared_memory_budget(cc)
    knobs = _KNOBS
    if weight_bits == 4:
        knobs = tuple((k, max(v, kpack)) if k == "block_k" else (k, v) for k, v in _KNOBS_4BIT)

    def fit(tile: Tile, weight_tiles: int, block_m: int) -> Tile:
        if weight_bits == 4:
            tile = dataclasses.replace(tile, block_k=max(2 * tile.block_k, kpack))
        nbytes = lambda t: smem_bytes(  # noqa: E731
            t, block_m=block_m, weight_tiles=weight_tiles, itemsize=itemsize, weight_bits=weight_bits
        )
        return shrink_to_fit(tile, nbytes, budget, knobs)

    while True:  # smaller blocks as a last resort: float32 activations with 256-row word chunks
        try:
            gate_up_tile = fit(gate_up, 2, block_m)
            splits = (
                k_splits(num_slots, num_experts, n_out, gate_up_tile.block_n, sm_count(cc))
                if weight_bits
                else 1
            )
            return MoeConfig(block_m, gate_up_tile, fit(down, 1, block_m), splits=splits)
        except ValueError:
            if block_m <= 16:
                raise
            block_m //= 2
