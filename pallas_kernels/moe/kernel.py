"""Pallas-Triton MoE experts: grouped SwiGLU GEMMs that read only the experts a batch touches.

Four steps, all inside the caller's jit (:func:`route`, :func:`gate_up`, :func:`down`,
:func:`combine`):

1. Routing (:mod:`.routing`, plain XLA): token slots grouped by expert into blocks of
   ``block_m`` rows; a block map of static worst-case size (idle blocks marked -1) with each
   block's filled rows and its expert's span of blocks. A single token's slots are one block each,
   read by the kernels from its routing ids (:class:`.routing.SlotBlocks`): no XLA kernel.
2. ``gate_up`` kernel: one program per (block, N tile). It gathers the block's token rows of
   ``x`` straight from ``[T, D]`` (no permuted copy of the activations), multiplies them with the
   expert's gate and up tiles in one K loop (two f32 accumulators), and applies the clamp and
   SwiGLU in the epilogue, writing ``act`` in block-padded row order (padding rows inside the
   row tile are exactly 0). With ``splits`` > 1 (decode: a handful of experts, too few programs
   to fill the GPU) each (block, N tile) is split over K: the programs write float32 partial sums
   of gate and up, and a small kernel adds them and applies the clamp and SwiGLU, reading only the
   blocks' filled rows (:func:`_sum_splits`; XLA's fusion read every worst-case row, and the down
   kernel doing the sum itself measured slower: its tile lost a stage and every D tile re-read them).
3. ``down`` kernel: one program per (block, D tile); ``act @ down_e``, rows scattered back to
   slot order ``[T * k, D]``.
4. The weighted sum over the k slots of a token: one XLA fusion.

Idle programs (blocks beyond the routing's need, or blocks of a filtered expert) exit at once.
Programs are numbered expert by expert, then output tile, then block (:func:`_block_and_tile`):
the blocks of one expert that share a weight tile run side by side, so only the first of them
reads it from HBM and the others hit L2, and all tiles of an expert run close together (its
gathered ``x`` rows stay in L2). A block multiplies only the rows it holds, rounded up to a
power of two (:func:`_with_row_tiles`), and an expert's small last block rides on the block
before it, which multiplies those rows with the weight tiles it already has in shared memory
(H100, T = 4096: 4.7 vs 4.9 ms for routing + gate|up, ``benchmarks/results/moe-h100-sweep-*.md``).
With decode-sized batches ``block_m`` almost always covers all of an expert's slots, so each
touched expert's weights are streamed from HBM once (see :mod:`.tuning`). Both kernels read
weights only through :func:`pallas_kernels.quant.tiles.pieces`: bf16 / float32 weights as
``[block_k, block_n]`` slices, INT4 / FP8 / FP4 experts (a
:class:`~pallas_kernels.quant.layout.QuantizedWeight` per matrix) dequantized in the K loop
to the activations' dtype, so quantized experts stream 4 or 8 bits per weight.

Loads and stores that can touch padding (the gathered ``x`` rows, the ``y`` scatter) carry
explicit masks and ``other``; the weight, ``act`` and block-map accesses are in bounds by
construction (tiles divide D and N, nothing overhangs), so JAX 0.11.2 and 0.12 agree.

Weights use :func:`.ref.pack_experts`'s layout (``gate_up [E, D, 2N]``, ``down [E, N, D]``, dense or
quantized), so packed weights work with the reference backend too and switching backends needs no
repacking. With ``layer`` they are stacks over scanned layers (``[L, E, D, 2N]``, ``[L, E, N, D]``)
read in place at that traced layer (:func:`pallas_kernels.quant.tiles.operands`): a scan
over layers then never copies a layer's experts out of the stack for the kernels.

Design notes and measurements: the kernel notes (docs/kernels.md §5; quantized experts §6).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels._triton import compiler_params, dot_precision, fit_block, pl, pltriton
from pallas_kernels.moe import routing, tuning
from pallas_kernels.quant import tiles
from pallas_kernels.quant.decode import fp_decode
from pallas_kernels.quant.decode import int4_decode as int4_decode_mode
from pallas_kernels.quant.layout import QuantizedWeight

__all__ = ["combine", "down", "gate_up", "moe_experts", "route"]

_EXPERT, _ROWS, _SPAN_START, _SPAN_LEN = range(4)  # rows of the per-block metadata the kernels read


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """How the kernels read the routing's block map (static): from the routing ids themselves
    (``per_slot``, :class:`.routing.SlotBlocks`: one operand, no XLA kernel before them), or from
    the metadata table and ``row_slot`` that :func:`.routing.group_by_expert` builds (two)."""

    per_slot: bool
    block_m: int
    num_experts: int

    @classmethod
    def of(cls, bmap: routing.BlockMap | routing.SlotBlocks, block_m: int, num_experts: int) -> _Blocks:
        return cls(isinstance(bmap, routing.SlotBlocks), block_m, num_experts)

    @staticmethod
    def operands(bmap: routing.BlockMap | routing.SlotBlocks) -> tuple[jax.Array, ...]:
        if isinstance(bmap, routing.SlotBlocks):
            return (bmap.ids,)
        meta = jnp.stack([bmap.block_expert, bmap.block_rows, bmap.span_start, bmap.span_len])
        return meta, bmap.row_slot

    def reader(self, refs: tuple) -> tuple[_TableReader | _SlotReader, tuple]:
        """The reader of this map's operands at the head of a kernel's ``refs``, and the rest."""
        if self.per_slot:
            return _SlotReader(refs[0], self.block_m, self.num_experts), refs[1:]
        return _TableReader(*refs[:2]), refs[2:]


@dataclasses.dataclass(frozen=True)
class _TableReader:
    meta_ref: Any  # [4, blocks]: expert, filled rows, span start, span length
    row_slot_ref: Any  # [blocks * block_m]

    def expert(self, block):
        return self.meta_ref[_EXPERT, block]

    def rows(self, block):
        return self.meta_ref[_ROWS, block]

    def span(self, block):
        return self.meta_ref[_SPAN_START, block], self.meta_ref[_SPAN_LEN, block]

    def slots(self, rows: pl.Slice) -> jax.Array:
        return self.row_slot_ref[rows]


@dataclasses.dataclass(frozen=True)
class _SlotReader:
    """Block b is slot b (:class:`.routing.SlotBlocks`): expert ``ids[b]`` (idle outside ``[0, E)``),
    one filled row holding slot b, a span of itself alone (so no block ever absorbs another)."""

    ids_ref: Any  # [slots]
    block_m: int
    num_experts: int

    def _id(self, block):
        block = jnp.minimum(block, self.ids_ref.shape[0] - 1)  # a traced branch never taken may ask past it
        slot_id = self.ids_ref[block]
        return slot_id, (slot_id >= 0) & (slot_id < self.num_experts)

    def expert(self, block):
        slot_id, valid = self._id(block)
        return jnp.where(valid, slot_id, -1)

    def rows(self, block):
        return self._id(block)[1].astype(jnp.int32)

    def span(self, block):
        return block, jnp.int32(1)

    def slots(self, rows: pl.Slice) -> jax.Array:
        block = rows.start // self.block_m
        first = jnp.arange(rows.size, dtype=jnp.int32) == 0
        return jnp.where(first & self._id(block)[1], block, -1)


def _fit(block: int, dim: int, what: str, floor: int = 16) -> int:
    """:func:`pallas_kernels._triton.fit_block` for the expert weights' tiles."""
    return fit_block(block, dim, floor=floor, what=what, op="moe_experts")


def _block_and_tile(blocks, n_tiles: int, pid=None) -> tuple[jax.Array, jax.Array]:
    """(block, output tile) of this program (or of program ``pid``). An expert owning blocks
    ``[s, s + c)`` owns programs ``[s * n_tiles, (s + c) * n_tiles)``; inside that range the block
    index runs fastest, so the ``c`` programs that read the same weight tile are adjacent in
    launch order."""
    pid = pl.program_id(0) if pid is None else pid
    owner = pid // n_tiles  # some block of the same expert
    start, count = blocks.span(owner)
    local = pid - start * n_tiles
    return start + local % count, local // count


def _row_powers(top: int, bottom: int) -> list[tuple[int, int]]:
    """``(m, lower)`` for m = top, top/2, ... bottom: row tile m serves ``lower < rows <= m``."""
    out, m = [], top
    while m >= bottom:
        out.append((m, m // 2 if m // 2 >= bottom else 0))
        m //= 2
    return out


def _with_row_tiles(blocks, block, *, block_m: int, min_m: int, absorb_m: int, body) -> None:
    """Run ``body(m, extra)`` for this block: ``m`` rows of its own, ``extra`` rows of the next.

    A block runs with the smallest power-of-two row tile ``m`` in ``[min_m, block_m]`` that holds
    its filled rows (valid rows are a prefix), so a partly filled block multiplies ``m`` rows, not
    ``block_m``. An expert's last block with at most ``absorb_m`` rows is absorbed: the block
    before it also multiplies those rows (``extra``, a power of two >= 16) with the weight tiles it
    has already loaded, and the last block's own programs exit. Without that, a few-row tail
    block streams the whole weight slab again for a sliver of the work.
    """
    rows = blocks.rows(block)
    start, count = blocks.span(block)
    last = start + count - 1
    plain = rows > 0
    if absorb_m:
        tail_rows = blocks.rows(last)
        absorbed = (count >= 2) & (tail_rows <= absorb_m)
        plain &= ~absorbed | (
            block < last - 1
        )  # the last two blocks run as one (blocks before last are full)
        for extra, lower in _row_powers(absorb_m, 16):
            pl.when(absorbed & (block == last - 1) & (tail_rows > lower) & (tail_rows <= extra))(
                functools.partial(body, block_m, extra)
            )
    for m, lower in _row_powers(block_m, min_m):
        pl.when(plain & (rows > lower) & (rows <= m))(functools.partial(body, m, 0))


def _row_groups(block, block_m: int, m: int, extra: int) -> list[tuple[pl.Slice, int]]:
    """Row ranges a program multiplies: its block's first ``m`` rows, and the next block's first
    ``extra`` rows when it absorbs that block."""
    groups = [(pl.ds(pl.multiple_of(block * block_m, block_m), m), m)]
    if extra:
        groups.append((pl.ds(pl.multiple_of((block + 1) * block_m, block_m), extra), extra))
    return groups


def _gate_up_kernel(
    *refs,
    map_spec: _Blocks,
    w_spec: tiles.WeightSpec,
    n_inter: int,
    top_k: int,
    block_m: int,
    min_m: int,
    absorb_m: int,
    block_n: int,
    block_k: int,
    n_tiles: int,
    splits: int,
    swiglu_limit: float | None,
    precision,
):
    blocks, (x_ref, *w_refs, act_ref) = map_spec.reader(refs)
    layer, w_refs = tiles.layer_lead(w_spec, w_refs)
    n_programs = pl.num_programs(0) // splits
    split, pid = pl.program_id(0) // n_programs, pl.program_id(0) % n_programs
    block, tile = _block_and_tile(blocks, n_tiles, pid)
    n0 = pl.multiple_of(tile * block_n, block_n)
    lead = (*layer, blocks.expert(block))
    k_steps = x_ref.shape[1] // block_k // splits  # this program's share of the K loop

    def run(m: int, extra: int) -> None:
        groups = _row_groups(block, block_m, m, extra)
        gathers = []  # (token of each row, row valid) per group
        for rows, _ in groups:
            slots = blocks.slots(rows)
            gathers.append((jnp.where(slots >= 0, slots // top_k, 0), slots >= 0))

        def step(i, acc):
            k0 = pl.multiple_of((split * k_steps + i) * block_k, block_k)
            tile_at = lambda n: tiles.pieces(w_spec, w_refs, lead, k0, n, block_k, block_n, x_ref.dtype)  # noqa: E731
            for (offset, length, w_gate), (_, _, w_up) in zip(tile_at(n0), tile_at(n_inter + n0)):
                cols = k0 + offset + jnp.arange(length, dtype=jnp.int32)
                out = []
                for (gate, up), (tokens, valid) in zip(acc, gathers):
                    xs = pltriton.load(x_ref.at[tokens[:, None], cols[None, :]], mask=valid[:, None], other=0)
                    gate += jnp.dot(xs, w_gate, preferred_element_type=jnp.float32, precision=precision)
                    up += jnp.dot(xs, w_up, preferred_element_type=jnp.float32, precision=precision)
                    out.append((gate, up))
                acc = tuple(out)
            return acc

        zeros = tuple((jnp.zeros((n, block_n), jnp.float32),) * 2 for _, n in groups)
        acc = jax.lax.fori_loop(0, k_steps, step, zeros)
        for (rows, _), (gate, up) in zip(groups, acc):
            if splits > 1:  # partial sums: the SwiGLU waits for every split (:func:`gate_up`)
                act_ref[split, rows, pl.ds(n0, block_n)] = gate
                act_ref[split, rows, pl.ds(n_inter + n0, block_n)] = up
            else:
                act_ref[rows, pl.ds(n0, block_n)] = _swiglu(gate, up, swiglu_limit).astype(act_ref.dtype)

    _with_row_tiles(blocks, block, block_m=block_m, min_m=min_m, absorb_m=absorb_m, body=run)


def _swiglu(gate, up, limit: float | None):
    """silu(gate) * up, with gate clamped to <= limit and up to [-limit, limit] (V4's clamp)."""
    if limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def _down_kernel(
    *refs,
    map_spec: _Blocks,
    w_spec: tiles.WeightSpec,
    block_m: int,
    min_m: int,
    absorb_m: int,
    block_n: int,
    block_k: int,
    n_tiles: int,
    precision,
):
    blocks, (act_ref, *w_refs, y_ref) = map_spec.reader(refs)
    layer, w_refs = tiles.layer_lead(w_spec, w_refs)
    block, tile = _block_and_tile(blocks, n_tiles)
    d0 = pl.multiple_of(tile * block_n, block_n)
    lead = (*layer, blocks.expert(block))
    n_inter = act_ref.shape[1]

    def run(m: int, extra: int) -> None:  # reads only act rows the gate|up program of (m, extra) wrote
        groups = _row_groups(block, block_m, m, extra)

        def step(i, acc):
            k0 = pl.multiple_of(i * block_k, block_k)
            for offset, length, w in tiles.pieces(
                w_spec, w_refs, lead, k0, d0, block_k, block_n, act_ref.dtype
            ):
                acc = tuple(
                    a
                    + jnp.dot(
                        act_ref[rows, pl.ds(k0 + offset, length)],
                        w,
                        preferred_element_type=jnp.float32,
                        precision=precision,
                    )
                    for a, (rows, _) in zip(acc, groups)
                )
            return acc

        zeros = tuple(jnp.zeros((n, block_n), jnp.float32) for _, n in groups)
        acc = jax.lax.fori_loop(0, n_inter // block_k, step, zeros)
        cols = d0 + jnp.arange(block_n, dtype=jnp.int32)
        for (rows, n), out in zip(groups, acc):
            slots = blocks.slots(rows)
            valid = slots >= 0
            # Padding rows aim at distinct spare rows past the slots: masked off on the GPU, and the
            # interpreter (which writes masked lanes back unchanged) sees no duplicate destinations.
            spare = y_ref.shape[0] - n + jnp.arange(n, dtype=jnp.int32)
            dest = y_ref.at[jnp.where(valid, slots, spare)[:, None], cols[None, :]]
            pltriton.store(dest, out.astype(y_ref.dtype), mask=valid[:, None])

    _with_row_tiles(blocks, block, block_m=block_m, min_m=min_m, absorb_m=absorb_m, body=run)


def moe_experts(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    experts: dict,
    *,
    swiglu_limit: float | None = None,
    layer: jax.Array | None = None,
    interpret: bool = False,
    config: tuning.MoeConfig | None = None,
    decode: str | None = None,
    int4_decode: str | None = None,
) -> jax.Array:
    """out[t] = sum_j w[t,j] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t,j].

    x [T, D]; topk_ids [T, k] int32 (ids outside [0, E) contribute nothing); topk_weights [T, k];
    experts from :func:`.ref.pack_experts`. ``swiglu_limit`` clamps gate to <= limit and up to
    [-limit, limit]. ``config`` overrides the tuning table (benchmark sweeps). D and N must be
    multiples of 16. Dense experts compute in their own dtype (x is cast to it); quantized experts
    are dequantized to x's dtype (``decode``: e4m3 path, see
    :func:`pallas_kernels.quant.decode.fp_decode`; ``int4_decode``: INT4 arithmetic, see
    :func:`pallas_kernels.quant.decode.int4_decode`). ``layer`` (int32 scalar, may be
    traced): the experts are stacks over layers, read in place at that layer (module docstring).
    Returns [T, D] in x's dtype.
    """
    num_experts = experts["gate_up"].shape[-3]
    quantized = isinstance(experts["gate_up"], QuantizedWeight)
    cfg = config or default_config(x, topk_ids, experts)
    decode = fp_decode(decode) if quantized else None
    int4 = int4_decode_mode(int4_decode, interpret=interpret) if quantized else None
    bmap = route(topk_ids, num_experts, cfg.block_m)
    act = gate_up(
        x,
        bmap,
        experts["gate_up"],
        cfg,
        top_k=topk_ids.shape[1],
        swiglu_limit=swiglu_limit,
        layer=layer,
        interpret=interpret,
        decode=decode,
        int4_decode=int4,
    )
    y = down(
        act,
        bmap,
        experts["down"],
        cfg,
        num_slots=topk_ids.size,
        layer=layer,
        interpret=interpret,
        decode=decode,
        int4_decode=int4,
    )
    return combine(y, topk_ids, topk_weights, num_experts).astype(x.dtype)


def default_config(x: jax.Array, topk_ids: jax.Array, experts: dict) -> tuning.MoeConfig:
    """The tuning table's config for these tokens, routing and experts (what :func:`moe_experts` uses
    when given none; benchmark sweeps start from it)."""
    w = experts["gate_up"]
    quantized = isinstance(w, QuantizedWeight)
    return tuning.choose(
        topk_ids.size,
        w.shape[-3],
        itemsize=(x if quantized else w).dtype.itemsize,
        weight_bits=(4 if w.packed else 8) if quantized else None,
        kpack=w.kpack if quantized else 0,
        n_out=w.shape[-1] // 2,
    )


def route(topk_ids: jax.Array, num_experts: int, block_m: int) -> routing.BlockMap | routing.SlotBlocks:
    """The block map: one block per slot for a single token (its experts are distinct, nothing to
    group; the kernels read its ids as they are), slots grouped by expert otherwise."""
    if topk_ids.shape[0] == 1:
        return routing.SlotBlocks(topk_ids.reshape(-1).astype(jnp.int32))
    return routing.group_by_expert(topk_ids, num_experts, block_m)


def _absorb_m(cfg: tuning.MoeConfig) -> int:
    """Largest tail a block absorbs: a power of two in [16, block_m / 4], or 0 (never)."""
    m = min(cfg.absorb_m, cfg.block_m // 4)
    return 1 << (m.bit_length() - 1) if m >= 16 else 0


def _expert_matrix(w, layer) -> tuple[int, int]:
    """``(K, N)`` of each expert's matrix in ``w``: ``[E, K, N]``, or ``[L, E, K, N]`` with a layer."""
    if len(w.shape) != (3 if layer is None else 4):
        raise ValueError(f"moe_experts: expert weights of shape {w.shape} with layer={layer}")
    return w.shape[-2], w.shape[-1]


def gate_up(
    x: jax.Array,
    bmap: routing.BlockMap | routing.SlotBlocks,
    w: jax.Array | QuantizedWeight,
    cfg: tuning.MoeConfig,
    *,
    top_k: int,
    swiglu_limit: float | None = None,
    layer: jax.Array | None = None,
    interpret: bool = False,
    decode: str | None = None,
    int4_decode: str | None = None,
) -> jax.Array:
    """``act [blocks * block_m, N]``: SwiGLU of the gathered token rows through their expert's
    gate|up weights ``w [E, D, 2N]`` (dense, or a quantized stack; ``[L, E, D, 2N]`` read at
    ``layer``), in block-padded row order."""
    d_model, two_n = _expert_matrix(w, layer)
    spec, arrays = tiles.operands(w, decode, int4_decode, layer, interpret=interpret)
    dtype = w.dtype if spec.format is None else x.dtype  # dense experts set the dtype; quantized follow x
    k_floor = max(spec.kpack, 16)
    n_inter, bm = two_n // 2, cfg.block_m
    block_n = _fit(cfg.gate_up.block_n, n_inter, "N")
    block_k = _fit(max(cfg.gate_up.block_k, k_floor), d_model, "D", k_floor)
    splits = _k_splits(cfg.splits, d_model // block_k)
    n_blocks, n_tiles = bmap.n_blocks, n_inter // block_n
    rows = n_blocks * bm
    out = pl.pallas_call(
        functools.partial(
            _gate_up_kernel,
            map_spec=_Blocks.of(bmap, bm, w.shape[-3]),
            w_spec=spec,
            n_inter=n_inter,
            top_k=top_k,
            block_m=bm,
            min_m=min(cfg.min_block_m, bm),
            absorb_m=_absorb_m(cfg),
            block_n=block_n,
            block_k=block_k,
            n_tiles=n_tiles,
            splits=splits,
            swiglu_limit=swiglu_limit,
            precision=dot_precision(dtype),
        ),
        out_shape=jax.ShapeDtypeStruct((splits, rows, two_n), jnp.float32)
        if splits > 1
        else jax.ShapeDtypeStruct((rows, n_inter), dtype),
        grid=(n_blocks * n_tiles * splits,),
        compiler_params=compiler_params(cfg.gate_up.num_warps, cfg.gate_up.num_stages),
        interpret=interpret,
        name="moe_gate_up",
    )(*_Blocks.operands(bmap), x.astype(dtype), *arrays)
    # Rows of blocks no program ran hold whatever the buffer held: the down kernel never reads them.
    if splits == 1:
        return out
    return _sum_splits(out, bmap, bm, w.shape[-3], swiglu_limit, dtype, interpret=interpret)


_SUM_BLOCK_N = 128  # act columns per program of the splits' sum


def _sum_splits_kernel(
    *refs, map_spec: _Blocks, splits: int, n_inter: int, block_m: int, block_n: int, n_tiles: int, limit
):
    blocks, (parts_ref, act_ref) = map_spec.reader(refs)
    block, tile = pl.program_id(0) // n_tiles, pl.program_id(0) % n_tiles

    @pl.when(blocks.rows(block) > 0)
    def _():
        rows = pl.ds(pl.multiple_of(block * block_m, block_m), block_m)
        valid = (blocks.slots(rows) >= 0)[:, None]
        cols = tile * block_n + jnp.arange(block_n, dtype=jnp.int32)[None, :]
        row_ids = block * block_m + jnp.arange(block_m, dtype=jnp.int32)[:, None]

        def part(split: int, first: int) -> jax.Array:
            at = parts_ref.at[jnp.int32(split), row_ids, first + cols]
            return pltriton.load(at, mask=valid, other=0.0)

        gate, up = part(0, 0), part(0, n_inter)
        for split in range(1, splits):
            gate, up = gate + part(split, 0), up + part(split, n_inter)
        act = _swiglu(gate, up, limit).astype(act_ref.dtype)
        act_ref[rows, pl.ds(pl.multiple_of(tile * block_n, block_n), block_n)] = act


def _sum_splits(parts, bmap, block_m: int, num_experts: int, limit, dtype, *, interpret: bool) -> jax.Array:
    """``act [rows, N]`` from gate|up's K-split partial sums ``[splits, rows, 2N]``: added in split
    order, clamped and activated. One program per (block, 128 columns) reads only the block's filled
    rows (masked loads) and exits at once for an idle block, so the bytes follow the routing, not
    the block map's worst case: 16 tokens at TP 2 have 2,304 worst-case rows, and XLA's fusion for
    the same sum read all of them from 4 splits, 75 MB in 19.5 us a layer on an H200
    (``decode_anatomy-h200-hlo16.md``). Rows past a block's filled ones are written 0; rows of idle
    blocks are left as they were (the down kernel reads neither)."""
    splits, rows, two_n = parts.shape
    n_inter = two_n // 2
    block_n = _fit(_SUM_BLOCK_N, n_inter, "N")
    n_tiles = n_inter // block_n
    return pl.pallas_call(
        functools.partial(
            _sum_splits_kernel,
            map_spec=_Blocks.of(bmap, block_m, num_experts),
            splits=splits,
            n_inter=n_inter,
            block_m=block_m,
            block_n=block_n,
            n_tiles=n_tiles,
            limit=limit,
        ),
        out_shape=jax.ShapeDtypeStruct((rows, n_inter), dtype),
        grid=(bmap.n_blocks * n_tiles,),
        compiler_params=compiler_params(4, 1),
        interpret=interpret,
        name="moe_sum_splits",
    )(*_Blocks.operands(bmap), parts)


def _k_splits(splits: int, k_steps: int) -> int:
    """The largest split count <= ``splits`` that divides the K loop's steps."""
    return max(s for s in range(1, splits + 1) if k_steps % s == 0)


def down(
    act: jax.Array,
    bmap: routing.BlockMap | routing.SlotBlocks,
    w: jax.Array | QuantizedWeight,
    cfg: tuning.MoeConfig,
    *,
    num_slots: int,
    layer: jax.Array | None = None,
    interpret: bool = False,
    decode: str | None = None,
    int4_decode: str | None = None,
) -> jax.Array:
    """``y [num_slots + block_m, D]``: each slot's ``act`` row through its expert's down weights
    ``w [E, N, D]`` (dense, or a quantized stack; ``[L, E, N, D]`` read at ``layer``), scattered
    back to slot order (rows of dropped slots and the spare tail are never written)."""
    n_inter, d_model = _expert_matrix(w, layer)
    spec, arrays = tiles.operands(w, decode, int4_decode, layer, interpret=interpret)
    k_floor = max(spec.kpack, 16)
    bm = cfg.block_m
    block_n = _fit(cfg.down.block_n, d_model, "D")
    block_k = _fit(max(cfg.down.block_k, k_floor), n_inter, "N", k_floor)
    n_blocks, n_tiles = bmap.n_blocks, d_model // block_n
    return pl.pallas_call(
        functools.partial(
            _down_kernel,
            map_spec=_Blocks.of(bmap, bm, w.shape[-3]),
            w_spec=spec,
            block_m=bm,
            min_m=min(cfg.min_block_m, bm),
            absorb_m=_absorb_m(cfg),
            block_n=block_n,
            block_k=block_k,
            n_tiles=n_tiles,
            precision=dot_precision(act.dtype),
        ),
        out_shape=jax.ShapeDtypeStruct((num_slots + bm, d_model), act.dtype),
        grid=(n_blocks * n_tiles,),
        compiler_params=compiler_params(cfg.down.num_warps, cfg.down.num_stages),
        interpret=interpret,
        name="moe_down",
    )(*_Blocks.operands(bmap), act, *arrays)


def combine(y: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, num_experts: int) -> jax.Array:
    """``[T, D]`` float32: each token's slots weighted and summed (one XLA fusion). Rows of
    filtered slots were never written: select, never multiply, so garbage cannot leak."""
    n_tokens, top_k = topk_ids.shape
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    y = y[: n_tokens * top_k].reshape(n_tokens, top_k, -1).astype(jnp.float32)
    weighted = jnp.where(valid[..., None], y * topk_weights.astype(jnp.float32)[..., None], 0.0)
    return weighted.sum(axis=1)
