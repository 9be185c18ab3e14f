"""Tile sizes for the hyper-connection kernels, per GPU compute capability.

Both kernels are memory-bound (the mixing GEMM has N = (2 + n) n = 24 columns). ``block_t`` is 16
tokens, the smallest MMA M. ``hc_pre`` keeps one ``[block_t, block_k]`` float32 stream tile and three
``[block_k, 16]`` weight tiles per loop step in shared memory, ``num_stages`` deep; the table keeps
``block_k`` at 128 on every part (24 KiB x stages, inside the 99 KiB consumer budget), which the
shared-memory fit check below confirms per device. ``block_d`` bounds the register tiles of the
collapse and of ``hc_post`` (``[block_t, n, block_d]`` float32).

``splits`` divides hc_pre's ``n D`` mixing columns over programs (:mod:`.kernel`): with one
program per 16 tokens and 128 column steps each, the fused kernel runs a long dependent chain on
few SMs at decode (H100: ~240 us at T <= 512 for what the bandwidth moves in ~1 us). The rule
(``splits = 0``) picks the power of two that brings the mixing grid to about ``4 x SMs`` programs,
capped at one column step per program, and the fused kernel (``splits = 1``) once the token blocks
alone fill the SMs (measured on H100: :func:`split_rule`).
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


@dataclasses.dataclass(frozen=True)
class MhcConfig:
    block_t: int
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    splits: int = 0  # hc_pre column splits: 0 = the rule in choose(), 1 = the fused kernel


TABLE: dict[int, MhcConfig] = {
    80: MhcConfig(block_t=16, block_k=128, block_d=128, num_warps=4, num_stages=3),
    86: MhcConfig(block_t=16, block_k=128, block_d=128, num_warps=4, num_stages=2),
    89: MhcConfig(block_t=16, block_k=128, block_d=128, num_warps=4, num_stages=2),
    90: MhcConfig(block_t=16, block_k=128, block_d=128, num_warps=4, num_stages=3),
    100: MhcConfig(block_t=16, block_k=128, block_d=128, num_warps=4, num_stages=3),
    120: MhcConfig(block_t=16, block_k=128, block_d=128, num_warps=4, num_stages=2),
    121: MhcConfig(block_t=16, block_k=128, block_d=128, num_warps=4, num_stages=2),
}
DEFAULT = MhcConfig(block_t=16, block_k=128, block_d=128, num_warps=4, num_stages=2)


def smem_bytes(cfg: MhcConfig, n: int) -> int:
    """hc_pre's pipelined loop: a float32 stream tile and the pre / post / comb weight tiles."""
    width = max(16, n)
    stage = 4 * cfg.block_k * (cfg.block_t + 2 * width + n * n)
    return shared_memory_bytes(stage=stage, num_stages=cfg.num_stages)


def choose(t: int, n: int, d: int) -> MhcConfig:
    """Config for ``t`` tokens of ``n`` streams of width ``d``."""
    cc = compute_capability()
    cfg = TABLE.get(cc, DEFAULT)
    cfg = dataclasses.replace(
        cfg,
        block_k=min(cfg.block_k, tile_pad(n * d)),
        block_d=min(cfg.block_d, tile_pad(d)),
    )
    cfg = shrink_to_fit(
        cfg, lambda c: smem_bytes(c, n), shared_memory_budget(cc), (("num_stages", 1), ("block_k", 16))
    )
    if cfg.splits == 0:
        cfg = dataclasses.replace(cfg, splits=split_rule(t, n * d, cfg.block_t, cfg.block_k, sm_count(cc)))
    return cfg


def split_rule(t: int, columns: int, block_t: int, block_k: int, sms: int) -> int:
    """Power-of-two column splits bringing ``token blocks x splits`` to about ``4 x sms`` programs,
    at most one ``block_k`` step per program; 1 (the fused kernel) once there are as many token
    blocks as SMs. H100, V4-Flash (16384 columns): split 99.7 / 107.9 / 148.0 / 32.3 / 83.2 us
    against fused 314.7 / 269.3 / 249.8 / 246.1 / 241.9 us at T = 1 / 8 / 32 / 128 / 512; at
    T = 4096 (256 token blocks) fused 452.6 us, 2 splits 526.8 us."""
    t_blocks, steps = -(-t // block_t), -(-columns // block_k)
    if t_blocks >= sms:
        return 1
    splits = 1
    while t_blocks * splits * 2 <= 4 * sms and splits * 2 <= steps:
        splits *= 2
    return splits
