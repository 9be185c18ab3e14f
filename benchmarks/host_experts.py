"""Routed experts on the CPU: the host experts' kernel against the host's own memory bandwidth.

For a preset's expert shapes (GLM-5.2: D 6144, N 2048, top-8; DeepSeek-V4-Flash: D 4096, N 2048,
top-6) builds one MoE layer of ``--experts`` host-resident experts in a weight format (random codes
in the format's layout), routes ``T`` tokens to ``k`` of them each, and times
:meth:`jaxdsa.offload.host_experts.HostExperts.compute`, what a decode step's host callback runs,
at several thread counts. The ceiling is the host's measured read bandwidth at the same thread count
(a parallel sum over a 4 GiB array); the rate is the bytes of the experts the tokens chose (codes,
scales, zero points) over the time. XLA:CPU running the same computation (the kernel's reference)
is timed once for comparison, and checked against the kernel.

    python -m benchmarks.host_experts --preset glm52 --formats int4 --tokens 1,4,8,32 --threads 16,32,64

Writes benchmarks/results/host_experts-<gpu><suffix>.md and .json.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import time

import jax
import ml_dtypes
import numba
import numpy as np

from benchmarks import harness
from benchmarks.serve_gpu import NAMES, PRESETS
from jaxdsa.offload.cpu_moe import BLOCK
from jaxdsa.offload.host_experts import HostExperts
from pallas_kernels.quant.layout import QuantizedWeight


def random_weight(rng: np.random.Generator, fmt: str, e: int, k: int, n: int):
    """``[e, k, n]`` experts in ``fmt``'s layout with random codes (their values do not matter to the
    time; FP8 codes avoid the NaN ones)."""
    if fmt == "int4":
        codes = rng.integers(0, 2**32, size=(e, k // 8, n), dtype=np.uint32).view(np.int32)
        scales = np.full((e, k // 32, n), 0.01, ml_dtypes.bfloat16)
        zeros = rng.integers(6, 11, size=(e, k // 32, n), dtype=np.uint8)
        return QuantizedWeight(codes, scales, zeros, "int4", (32, 1), 256)
    if fmt == "fp4":
        codes = rng.integers(0, 256, size=(e, k // 2, n), dtype=np.uint8)
        scales = np.full((e, k // 32, n), 122, np.uint8).view(ml_dtypes.float8_e8m0fnu)
        return QuantizedWeight(codes, scales, None, "fp4", (32, 1), 64)
    if fmt == "fp8":
        codes = rng.integers(0, 256, size=(e, k, n), dtype=np.uint8) & np.uint8(0x7E)
        scales = np.full((e, -(-k // 128), -(-n // 128)), 0.01, np.float32)
        return QuantizedWeight(codes.view(ml_dtypes.float8_e4m3fn), scales, None, "fp8", (128, 128), 0)
    raise ValueError(f"format {fmt!r}: int4, fp4 or fp8")


def expert_bytes(w) -> int:
    """Bytes of one expert of a stack (codes, scales, zero points)."""
    return sum(leaf.nbytes // leaf.shape[0] for leaf in jax.tree.leaves(w))


@numba.njit(parallel=True, cache=True)
def _read(a):
    total = 0
    for i in numba.prange(a.shape[0]):
        total += a[i]
    return total


def host_read_gbs(threads: int, nbytes: int = 4 << 30) -> float:
    """The host's read bandwidth at ``threads`` threads: the best of five parallel sums over ``nbytes``."""
    numba.set_num_threads(threads)
    a = np.ones(nbytes // 8, np.int64)
    _read(a)
    best = min(timed(_read, a) for _ in range(5))
    return nbytes / best / 1e9


def timed(fn, *args) -> float:
    """Seconds of one call of ``fn(*args)``."""
    began = time.perf_counter()
    fn(*args)
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="glm52")
    p.add_argument("--formats", default="int4", help="comma-separated: int4, fp4, fp8")
    p.add_argument("--experts", type=int, default=32, help="host-resident experts in the layer")
    p.add_argument("--tokens", default="1,4,8,32")
    p.add_argument("--threads", default="", help="comma-separated thread counts (default: all cores)")
    p.add_argument("--blocks", default="", help="comma-separated output columns per kernel task")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset]
    D, N, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    threads = [int(t) for t in args.threads.split(",") if t] or [numba.config.NUMBA_NUM_THREADS]
    blocks = [int(b) for b in args.blocks.split(",") if b] or [BLOCK]
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    ceilings = {t: host_read_gbs(t) for t in threads}
    rows = []
    for fmt in args.formats.split(","):
        experts = {
            "gate_up": random_weight(rng, fmt, args.experts, D, 2 * N),
            "down": random_weight(rng, fmt, args.experts, N, D),
        }
        per_expert = sum(expert_bytes(w) for w in experts.values())
        host = HostExperts(jax.device_put(experts, cpu), gpu=0, stacked=False, swiglu_limit=None)
        for T in [int(t) for t in args.tokens.split(",")]:
            x = rng.standard_normal((T, D)).astype(ml_dtypes.bfloat16)
            slots = np.stack([rng.permutation(args.experts)[:k] for _ in range(T)]).astype(np.int32)
            weights = rng.random((T, k)).astype(np.float32)
            read = len(np.unique(slots)) * per_expert
            check = ""
            if T == 1:
                host.threads = threads[-1]
                got = host.compute(x, slots, weights, 0)
                xla = min(timed(host.reference, x, slots, weights, 0) for _ in range(2))
                want = host.reference(x, slots, weights, 0)
                check = f"{harness.rel_l2(got, want):.1e}"
                rows.append(_row(fmt, T, "XLA:CPU (reference)", xla, read, ceilings[threads[-1]], ""))
            for t, block in itertools.product(threads, blocks):
                host.threads, host.block = t, block
                host.compute(x, slots, weights, 0)  # compiles on the first call
                call = (x, slots, weights, 0)
                best = min(timed(host.compute, *call) for _ in range(args.repeats))
                path = f"Numba kernel, {t} threads, {block} columns a task"
                rows.append(_row(fmt, T, path, best, read, ceilings[t], check))
            text = report(args, rows, ceilings, per_expert)
    path = harness.write_result("host_experts", text, args.suffix, rows)
    print(text)
    print(f"host_experts: wrote {path}")


def _row(fmt: str, tokens: int, path: str, seconds: float, read: int, ceiling: float, check: str) -> dict:
    rate = read / seconds / 1e9
    return {
        "format": fmt,
        "tokens": tokens,
        "path": path,
        "ms per layer": round(seconds * 1e3, 2),
        "experts read (MB)": round(read / 1e6, 1),
        "GB/s": round(rate, 1),
        "% of host read": f"{100 * rate / ceiling:.0f} %",
        "rel L2 vs reference": check,
    }


def report(args, rows: list[dict], ceilings: dict[int, float], per_expert: int) -> str:
    lines = harness.report_header(
        f"Routed experts on the CPU: {NAMES[args.preset]} shapes",
        {
            "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "numba": numba.__version__,
            "host read bandwidth": ", ".join(f"{ceilings[t]:.0f} GB/s at {t} threads" for t in ceilings),
            "host experts in the layer": args.experts,
            "bytes per expert": f"{per_expert / 1e6:.1f} MB",
        },
    )
    lines += [
        "One MoE layer's host side as a decode step's callback runs it: T tokens, each routed to k",
        "distinct host experts; ms per layer is the best of the repeats; GB/s counts the chosen experts'",
        "bytes once (codes, scales, zero points); the ceiling is a parallel read of 4 GiB at the same",
        "thread count. bf16 activations.",
        "",
        harness.markdown_table(rows, list(rows[0])),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
