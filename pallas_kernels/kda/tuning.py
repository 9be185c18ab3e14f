"""Tile sizes for the KDA kernels, per GPU compute capability. Nothing here is measured on a GPU yet.

Decode (:func:`pallas_kernels.kda.kernel.recurrent_step`) has no dot: a program holds a ``[K, block_v]``
float32 state tile in registers and reads and writes it once, so ``block_v`` only trades registers against
programs. 32 columns keep the tile at 32 float32 registers a thread with 4 warps (K = 128) and give
GLM-5.3-Flash's 64 heads x V = 128 four programs per head: 256 at B = 1, about two per SM.

Prefill (:func:`pallas_kernels.kda.kernel.chunked`) runs its chunk's dots on float32 operands. Its
shared memory is bounded by :func:`prefill_smem_bytes`, and ``block_v`` halves until that bound fits
the part (:func:`pallas_kernels._triton.shrink_to_fit`): 64 columns on sm_80 / sm_90, 32 on the 99 KiB
parts at K = 128, chunk 64.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import compute_capability, shared_memory_budget, shrink_to_fit, tile_pad

SUB = 16  # prefill sub-chunk: the diagonal blocks of the intra-chunk matrices (the smallest dot side)


@dataclasses.dataclass(frozen=True)
class KdaConfig:
    block_v: int  # value columns per program (power of two, >= 16)
    num_warps: int
    num_stages: int
    dot: str = "tf32x3"  # prefill dots: "tf32x3" (three TF32 tensor-core products) or "ieee"


DECODE = KdaConfig(block_v=32, num_warps=4, num_stages=1)
# One chunk step per loop iteration, and its loads feed elementwise math before any dot, so Triton's
# pipeliner has nothing to overlap: one stage.
PREFILL = KdaConfig(block_v=64, num_warps=8, num_stages=1)


def prefill_smem_bytes(cfg: KdaConfig, *, chunk: int, block_k: int) -> int:
    """Upper bound of one prefill program's shared memory: both float32 operands of its largest dot
    staged at once, twice for TF32x3 (the high and low TF32 halves of each operand).

    The dots are ``[chunk, K] x [K, block_v]`` (the state reads), ``[chunk, chunk] x [chunk, K]`` (the
    WY products), ``[K, chunk] x [chunk, block_v]`` (the state write) and ``[16, K] x [K, chunk]`` (the
    off-diagonal decay products). Layout-conversion and reduction scratch is per operation and no larger
    than one operand. At K = 128, chunk 64 it is what Triton 3.9 allocates, exactly (131072 bytes at
    block_v 64, 98304 at 32: cubins built on the CPU, docs/kernels.md §8); XLA's bundled Triton is not
    checked."""
    c, k, v = chunk, block_k, cfg.block_v
    largest = max(c * k + k * v, c * c + c * k, k * c + c * v, SUB * k + k * c)
    return largest * 4 * (2 if cfg.dot == "tf32x3" else 1)


def choose_decode(dv: int) -> KdaConfig:
    """Decode config for value width ``dv``."""
    return dataclasses.replace(DECODE, block_v=min(DECODE.block_v, tile_pad(dv)))


def choose_prefill(chunk: int, dk: int, dv: int, cc: int | None = None) -> KdaConfig:
    """Prefill config for ``chunk``-token steps at key / value widths ``dk`` / ``dv``, fitted to the shared
    memory of compute capability ``cc`` (default: the target being compiled for)."""
    cc = compute_capability() if cc is None else cc
    cfg = dataclasses.replace(PREFILL, block_v=min(PREFILL.block_v, tile_pad(dv)))
    nbytes = lambda c: prefill_smem_bytes(c, chunk=chunk, block_k=tile_pad(dk))  # noqa: E731
    return shrink_to_fit(cfg, nbytes, shared_memory_budget(cc), (("block_v", 16),))
