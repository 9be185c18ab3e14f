"""Tiles, K splits, warps and stages for ``quant_matmul``, per GPU compute capability.

Four regimes by the number of rows M (tokens), the first off until measured:

* ``gemv`` (M <= :attr:`_Entry.gemv_max_m`, 0 on every part: off): the matrix-vector kernel, no
  tensor cores (why, in :mod:`.kernel`), every row in one program, grid N tiles x K splits by the
  same split rule. ``JAXDSA_QMM_GEMV_MAX_M=<rows>`` replaces every part's row count for a whole
  run without code edits (:func:`gemv_max_m`; 0 turns the path off), and a ``config=`` with
  ``gemv=True`` takes it at any M (benchmark sweeps: ``QUANT_QMM_TILES=name:gemv=1+block_n=128``).
  Measured once, at its starting tile (64 columns, one 256-row INT4 chunk per step, 4 warps, 3
  stages), in a 10-layer GLM-5.2 INT4 decode at tp = 2 on 2 x H100 (traced kernel times,
  ``benchmarks/results/decode_anatomy-h100-glm52-int4-tp2-10l-{tc,gemv}{1,2}.md``): slower where
  it matters, so it stays off. ``o_proj`` (K 8192, N 6144) 38.5 against 23.6 us, the dense
  gate|up 58 against 33, ``q_a|kv_a|wk`` 12.4 against 11.0; only the shared experts' gate|up was
  faster (7.8 against 13.0). All linears of a step: 1.06 against 0.77 ms.
* ``stream`` (M <= 32, decode): a weight stream. One 16- or 32-row tile holds every token, so the
  grid is the N tiles times K splits; splits (partial sums added by one XLA fusion) give the GPU
  about two programs per SM, since a 2048-column projection has only 32 tiles of 64 columns.
* ``mid`` (M <= 128): 64-row tiles; weights are read once per 64 tokens.
* ``compute`` (prefill): 128 x 128 tensor-core tiles, no split unless the grid is smaller than the
  GPU. From ``dequantize_min_m`` rows on (512 on every listed part; measured on H100) the kernel is
  not used at all: the weight is dequantized once in XLA and XLA's GEMM multiplies (2.3x faster
  for INT4 at T = 4096 on H100), see :func:`dequantize_first`.

``block_k`` counts weight rows for 8-bit codes; 4-bit codes take twice as many rows per step (the
same bytes per load), except where a part's ``stream_rows_4bit`` says otherwise. Unless noted below
these are reasoned starting points, sized like the MoE kernel's measured tiles
(``pallas_kernels/moe/tuning.py``); ``benchmarks/linear_tiles.py`` is the decode sweep (each
kernel's traced time per tile variant) and ``benchmarks/quant.py`` the one across T. Every choice
is shrunk to the part's shared memory (:func:`smem_bytes`).

Measured so far: on H100 the 4-bit stream tiles run 3 stages, not 4 (INT4, GLM-5's ten linears summed:
311 vs 384 us at T = 1, 393 vs 464 at 32, ``benchmarks/results/quant-h100-stages.md``), which also
shortens their compile (Triton copies the unrolled K step per stage: 6-12 s each with 4 stages, 2-3 s
with 2, ``compile_time-h100-linears.md``; 3 not timed for the linears, the MoE layer took 11 s with 3
against 20 with 4); FP8 keeps 4 until measured.

And on H100 they step 64 weight rows at a time (two 32-row pieces), not 256. Each kernel's own time
at GLM-5.2's TP-4 widths, traced (``benchmarks/linear_tiles.py``,
``benchmarks/results/linear_tiles-h100-glm52-tp4-khalf.md``), INT4, T = 1: ``q_b`` 5.7 against 12.5
us, the shared expert's ``down`` 3.7 against 11.8, ``o_proj`` 12.1 against 13.4, ``q_a|kv_a`` 10.1
against 10.9, the dense ``gate|up`` 17.7 against 18.4; T = 8 and 32 alike (``q_b`` at 32: 6.6
against 23.3). With 256-row steps the split rule left a short projection one or two K steps per
program (``q_b``: 2048 rows, 8 splits), so nothing overlapped a program's loads with its
arithmetic; 128-row steps were in between, and 8 warps, 2 or 4 stages, 32- or 128-column tiles and
more or fewer programs per SM all lost (``linear_tiles-h100-glm52-tp4-t1.md``). The other parts keep
256 rows until the sweep has run on them.
"""

from __future__ import annotations

import dataclasses
import os

from pallas_kernels import _triton
from pallas_kernels._triton import (
    compute_capability,
    shared_memory_budget,
    shared_memory_bytes,
    shrink_to_fit,
    sm_count,
)
from pallas_kernels.quant.tiles import decoded_tile_bytes


@dataclasses.dataclass(frozen=True)
class QmmConfig:
    block_m: int  # rows per M tile; a GEMV config's: M itself (every row in one program, set by choose)
    block_n: int
    block_k: int  # weight rows per K step
    splits: int  # K splits; partial sums in float32, added outside the kernel
    num_warps: int
    num_stages: int
    gemv: bool = False  # the matrix-vector kernel: no tl.dot, every row in one program

    def m_tiles(self, m: int) -> int:
        """Programs along M for ``m`` rows (one for a GEMV config)."""
        return 1 if self.gemv else -(-m // self.block_m)


@dataclasses.dataclass(frozen=True)
class _Entry:
    stream: QmmConfig  # block_m and splits are set by choose()
    mid: QmmConfig
    compute: QmmConfig
    gemv: QmmConfig  # block_m and splits are set by choose()
    # From this many rows on, dequantize the weight once in XLA and let XLA's GEMM multiply (None:
    # never). Tensor-core tiles fed by an in-loop decode fall far behind a plain GEMM at prefill
    # sizes, while dequantizing costs one pass over the weight (~4.5 bytes per weight).
    dequantize_min_m: int | None = None
    stages_4bit: int | None = None  # stream tiles with 4-bit weights: stages (None: the tile's)
    # stream tiles with 4-bit weights: weight rows per K step (None: twice the tile's block_k, the
    # same bytes per load as 8-bit codes); at least the weight's packed chunk
    stream_rows_4bit: int | None = None
    gemv_max_m: int = 0  # the GEMV kernel up to this many rows (0: never; $JAXDSA_QMM_GEMV_MAX_M overrides)


_BIG = _Entry(  # H100 / H200 / B200: 227 KiB of shared memory per block
    stream=QmmConfig(16, 64, 128, 1, 4, 4),
    mid=QmmConfig(64, 128, 64, 1, 4, 4),
    compute=QmmConfig(128, 128, 64, 1, 8, 3),
    # not measured: 64 columns, 64 FP8 rows (a [64, 64] float32 accumulator per row, 32 registers
    # a thread at 4 warps), one 256-row INT4 word chunk (eight 32-row pieces) per step
    gemv=QmmConfig(1, 64, 64, 1, 4, 3, gemv=True),
    # H100, GLM-5's ten linears summed (benchmarks/results/quant-h100-ptx.md): INT4 1835 vs 2135 us
    # at T = 512, 2621 vs 4090 at 1024, 6674 vs 15071 at 4096, but 1563 vs 1214 at 256; FP8 1358 vs
    # 1421 at 512, 6242 vs 8991 at 4096. The other parts keep this row count until measured (vLLM's
    # AWQ path switches at 256 tokens for the same reason).
    dequantize_min_m=512,
)
# measured on H100: 3 stages, and 64-row K steps (two 32-row pieces; module docstring)
_HOPPER = dataclasses.replace(_BIG, stages_4bit=3, stream_rows_4bit=64)
_SMALL = _Entry(  # 99 KiB consumer / workstation parts
    stream=QmmConfig(16, 64, 128, 1, 4, 3),
    mid=QmmConfig(64, 64, 64, 1, 4, 3),
    compute=QmmConfig(128, 64, 64, 1, 4, 2),
    gemv=QmmConfig(1, 64, 64, 1, 4, 3, gemv=True),
    dequantize_min_m=512,
)
# gemv_max_m: 0 (off) on every part until measured; $JAXDSA_QMM_GEMV_MAX_M overrides it (docstring)
TABLE: dict[int, _Entry] = {
    80: _BIG,  # A100: 163 KiB, the same tiles fit
    86: _SMALL,
    89: _SMALL,
    90: _HOPPER,
    100: _BIG,
    120: _SMALL,
    121: _SMALL,
}
DEFAULT = dataclasses.replace(_SMALL, dequantize_min_m=None)  # unknown GPUs and the CPU interpreter

_MAX_SPLITS = 16
STREAM_MAX_M = 32  # the ``stream`` (decode) tiles' rows: one 16- or 32-row tile holds every token
GEMV_ENV = "JAXDSA_QMM_GEMV_MAX_M"


def smem_bytes(cfg: QmmConfig, *, itemsize: int, weight_bits: int) -> int:
    """Shared-memory bound (:func:`pallas_kernels._triton.shared_memory_bytes`): per stage the
    activation tile and the weight codes; resident, the dequantized weight tile
    (:func:`pallas_kernels.quant.tiles.decoded_tile_bytes`), none for a GEMV config, whose weights
    never become a tensor-core operand; the float32 output tile after."""
    decoded = decoded_tile_bytes(
        cfg.block_k * cfg.block_n, block_m=cfg.block_m, itemsize=itemsize, weight_bits=weight_bits
    )
    return shared_memory_bytes(
        stage=cfg.block_m * cfg.block_k * itemsize + cfg.block_k * cfg.block_n * weight_bits // 8,
        num_stages=cfg.num_stages,
        resident=0 if cfg.gemv else decoded,
        epilogue=cfg.block_m * cfg.block_n * 4,
    )


def dequantize_first(m: int, cc: int | None = None) -> bool:
    """Whether ``m`` rows are enough to dequantize the weight first (:attr:`_Entry.dequantize_min_m`)."""
    threshold = TABLE.get(compute_capability() if cc is None else cc, DEFAULT).dequantize_min_m
    return threshold is not None and m >= threshold


def gemv_max_m(cc: int | None = None) -> int:
    """Rows up to which ``quant_matmul`` takes the GEMV kernel: ``$JAXDSA_QMM_GEMV_MAX_M`` where set
    (every part; 0 turns it off), else the part's :attr:`_Entry.gemv_max_m`."""
    raw = os.environ.get(GEMV_ENV, "").strip()
    if raw:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(
                f"{GEMV_ENV}={raw!r}: expected a row count (0 turns the GEMV path off)"
            ) from None
    return TABLE.get(compute_capability() if cc is None else cc, DEFAULT).gemv_max_m


def fit_block(block: int, dim: int, floor: int, what: str) -> int:
    """:func:`pallas_kernels._triton.fit_block` for ``quant_matmul``'s tiles."""
    return _triton.fit_block(block, dim, floor=floor, what=what, op="quant_matmul")


def splits_for(
    programs: int, k_steps: int, cc: int | None = None, *, fill: float = 2, max_splits: int = _MAX_SPLITS
) -> int:
    """K splits for ``programs`` output tiles over ``k_steps`` K steps on this part (:func:`_splits`)."""
    return _splits(programs, k_steps, sm_count(cc), fill=fill, max_splits=max_splits)


def _splits(programs: int, k_steps: int, sms: int, *, fill: float = 2, max_splits: int = _MAX_SPLITS) -> int:
    """Power-of-two K splits (dividing the K steps) until there are about ``fill`` programs per SM
    (two: the table's rule; benchmark sweeps try others)."""
    splits = 1
    while programs * splits < fill * sms and splits < max_splits and k_steps % (2 * splits) == 0:
        splits *= 2
    return splits


def choose(
    m: int,
    k: int,
    n: int,
    *,
    itemsize: int,
    weight_bits: int,
    min_block_k: int,
    cc: int | None = None,
    gemv: bool | None = None,
) -> QmmConfig:
    """Config for ``[m, k] @ [k, n]`` with ``itemsize``-byte activations and ``weight_bits``-bit codes;
    ``min_block_k``: the weight's packed chunk (4-bit) or 16. ``gemv``: the GEMV tile (True) or the
    tensor-core ones (False) at any ``m``; None: GEMV up to :func:`gemv_max_m` rows."""
    cc = compute_capability() if cc is None else cc
    entry = TABLE.get(cc, DEFAULT)
    use_gemv = m <= gemv_max_m(cc) if gemv is None else gemv
    if use_gemv:
        cfg = dataclasses.replace(entry.gemv, block_m=m)
    elif m <= STREAM_MAX_M:
        cfg = dataclasses.replace(entry.stream, block_m=16 if m <= 16 else STREAM_MAX_M)
    else:
        cfg = entry.mid if m <= 128 else entry.compute
    if weight_bits == 4:
        stream = m <= STREAM_MAX_M and not cfg.gemv
        rows = entry.stream_rows_4bit if stream and entry.stream_rows_4bit else 2 * cfg.block_k
        cfg = dataclasses.replace(cfg, block_k=max(rows, min_block_k))
        if stream and entry.stages_4bit:
            cfg = dataclasses.replace(cfg, num_stages=entry.stages_4bit)
    # block_m last: float32 activations with 256-row word chunks need it on 99 KiB parts (a GEMV
    # config's block_m is M: never shrunk)
    knobs = (("num_stages", 2), ("block_k", min_block_k), ("block_n", 32), ("block_m", 16), ("num_stages", 1))
    knobs = tuple(knob for knob in knobs if not (cfg.gemv and knob[0] == "block_m"))
    nbytes = lambda c: smem_bytes(c, itemsize=itemsize, weight_bits=weight_bits)  # noqa: E731
    cfg = shrink_to_fit(cfg, nbytes, shared_memory_budget(cc), knobs)
    block_n = fit_block(cfg.block_n, n, 16, "N")
    block_k = fit_block(cfg.block_k, k, min_block_k, "K")
    programs = cfg.m_tiles(m) * (n // block_n)
    return dataclasses.replace(
        cfg, block_n=block_n, block_k=block_k, splits=_splits(programs, k // block_k, sm_count(cc))
    )
