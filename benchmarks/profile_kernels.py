"""Run chosen kernels once each inside a CUDA profiler range, for Nsight Compute.

The timing scripts say how fast a kernel is; this one lets ``ncu`` say why. Each case compiles
and warms up outside the range, then runs once inside ``cuProfilerStart``/``cuProfilerStop``, so
``--profile-from-start off`` captures exactly one launch of each kernel the case runs:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section LaunchStats --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python -m benchmarks.profile_kernels mla_h64_b32 topk_4096x131072

Without ncu it prints each case's kernel time from the harness's method, so a run can be
checked before it is profiled. Shapes are the benchmark scripts' (anchor shapes, bf16).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from benchmarks import harness, kernels_indexer, kernels_mla, moe
from pallas_kernels.indexer_logits import kernel as ikernel
from pallas_kernels.moe import kernel as mkernel
from pallas_kernels.sparse_mla import kernel as skernel
from pallas_kernels.topk import kernel as tkernel


def _mla(h: int, b: int, pool: int = kernels_mla.DECODE_POOL) -> Callable[[], tuple[Callable, tuple]]:
    def build():
        kv = jax.random.normal(jax.random.key(0), (pool, kernels_mla.D), jnp.bfloat16)
        q, idx = kernels_mla._make_set(jax.random.key(1), t=b, h=h, pool=pool)
        fn = functools.partial(skernel.sparse_mla, sm_scale=kernels_mla.SCALE, v_dim=kernels_mla.DV)
        return (lambda q, kv, idx: fn(q, kv, idx)), (q, kv, idx)

    return build


def _topk(t: int, s: int) -> Callable[[], tuple[Callable, tuple]]:
    def build():
        logits = jax.random.normal(jax.random.key(2), (t, s), jnp.float32)
        return (lambda x: tkernel.topk_indices(x, kernels_indexer.TOPK)), (logits,)

    return build


def _indexer_decode(heads: int, s: int) -> Callable[[], tuple[Callable, tuple]]:
    def build():
        args = kernels_indexer._paged_inputs(jax.random.key(3), heads=heads, s=s, batch=kernels_indexer.BATCH, t=kernels_indexer.BATCH, fp8=False)
        return ikernel.indexer_logits_paged, args

    return build


def _moe(t: int) -> Callable[[], tuple[Callable, tuple]]:
    def build():
        experts = moe._make_weights(jax.random.key(4))
        x, ids, w = moe._make_inputs(jax.random.key(5), t)
        return (lambda x, ids, w, e: mkernel.moe_experts(x, ids, w, e)), (x, ids, w, experts)

    return build


CASES: dict[str, Callable[[], tuple[Callable, tuple]]] = {
    "mla_h16_b1": _mla(16, 1),
    "mla_h64_b1": _mla(64, 1),
    "mla_h16_b128": _mla(16, 128),
    "mla_h64_b32": _mla(64, 32),
    "mla_h128_b32": _mla(128, 32),
    "mla_prefill_h64_t1024": _mla(64, 1024, kernels_mla.PREFILL_POOL),
    "topk_32x131072": _topk(32, 131072),
    "topk_4096x32768": _topk(4096, 32768),
    "topk_4096x131072": _topk(4096, 131072),
    "indexer_h64_s8192": _indexer_decode(64, 8192),
    "moe_t4096": _moe(4096),
}


def _profiler(name: str) -> Callable[[], None]:
    """``cuProfilerStart``/``Stop`` from the driver (present wherever a CUDA GPU is); no-op elsewhere."""
    try:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except OSError:
        return lambda: None
    return lambda: fn()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = p.parse_args(argv)
    start, stop = _profiler("cuProfilerStart"), _profiler("cuProfilerStop")
    for name in args.cases:
        fn, inputs = CASES[name]()
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(*inputs))  # compile + warm-up, outside the range
        us = harness.median_seconds(lambda: jitted(*inputs), 1, 5) * 1e6
        start()
        jax.block_until_ready(jitted(*inputs))
        stop()
        print(f"profile_kernels: {name}: {us:.1f} us per call (one input set, L2-warm)", flush=True)
        del inputs


if __name__ == "__main__":
    main()
