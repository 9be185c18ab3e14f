"""Tile sizes for the hyper-connection kernels, per GPU compute capability.

Both kernels are memory-bound (the mixing GEMM has N = (2 + n) n = 24 columns). ``block_t`` is 16
tokens, the smallest MMA M. ``hc_pre`` keeps one ``[block_t, block_k]`` float32 stream tile and three
``[block_k, 16]`` weight tiles per loop step in shared memory, ``num_stages`` deep; the table keeps
``block_k`` at 128 on every part (24 KiB x stages, inside the 99 KiB consumer budget), which the
shared-memory fit check below confirms per device. ``block_d`` bounds the register tiles of the
collapse and of ``hc_post`` (``[block_t, n, block_d]`` float32).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._triton import (
    compute_capability,
    shared_memory_budget,
    shared_memory_bytes,
    shrink_to_fit,
)


@dataclasses.dataclass(frozen=True)
class MhcConfig:
    block_t: int
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int


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


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


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
        block_k=min(cfg.block_k, max(16, _pow2_at_least(n * d))),
        block_d=min(cfg.block_d, max(16, _pow2_at_least(d))),
    )
    return shrink_to_fit(
        cfg, lambda c: smem_bytes(c, n), shared_memory_budget(cc), (("num_stages", 1), ("block_k", 16))
    )
