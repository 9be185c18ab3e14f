"""How many block-wide counts each top-k cutoff search needs, on CPU (no GPU, no timing).

The top-k kernel (``pallas_kernels/topk/kernel.py``) is bound by its block reductions on H100
(``benchmarks/results/profile-h100.md``): each probe of the cutoff search is one. This models both
searches in NumPy, step for step as the kernel takes them, and prints the mean and worst probe
counts over random chunks of several distributions, so a search can be judged before GPU time is
spent on it:

    python -m benchmarks.topk_probes [--chunk 8192] [--k 2048] [--trials 50]
"""

from __future__ import annotations

import argparse

import numpy as np

INT32_MIN = -(2**31)


def ordered_key(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(np.isfinite(x), bits ^ ((bits >> 31) & 0x7FFFFFFF), INT32_MIN)


def key_value(key: int) -> np.float32:
    bits = np.int64(key) ^ ((np.int64(key) >> 31) & 0x7FFFFFFF)
    return np.array([bits], np.int64).astype(np.int32).view(np.float32)[0]


def bisect_probes(key: np.ndarray, kk: int) -> int:
    t, probes = INT32_MIN, 0
    for bit in range(31, -1, -1):
        probe = (t + (1 << bit) + 2**31) % 2**32 - 2**31  # int32 wrap-around, as on the GPU
        count = int((key >= probe).sum())
        probes += 1
        if count >= kk:
            t = probe
        if count == kk:
            break
    return probes


def secant_probes(key: np.ndarray, kk: int) -> int:
    """Two bound reductions (min, max) plus the false-position probes."""
    valid = key > INT32_MIN
    lo, hi, c_lo, c_hi = int(key[valid].min()), int(key.max()) + 1, int(valid.sum()), 0
    w_lo = w_hi = 1.0
    side = slow = 0
    probes = 2
    while c_lo != kk and hi - 1 > lo:
        a, b = (c_lo - kk) * w_lo, (kk - c_hi) * w_hi
        frac = b / (a + b)
        v = np.float32(key_value(hi - 1) * (1 - frac) + key_value(lo) * frac)
        probe = (lo >> 1) + (hi >> 1) + (lo & hi & 1) if slow >= 2 else int(ordered_key(np.array([v]))[0])
        probe = min(max(probe, lo + 1), hi - 1)
        count = int((key >= probe).sum())
        probes += 1
        gap, up = c_lo - c_hi, count >= kk
        if up:
            w_hi, w_lo = (w_hi * 0.5 if side == 1 else 1.0), 1.0
            lo, c_lo = probe, count
        else:
            w_lo, w_hi = (w_lo * 0.5 if side == -1 else 1.0), 1.0
            hi, c_hi = probe, count
        side = 1 if up else -1
        slow = 0 if slow >= 2 else (slow + 1 if 2 * (c_lo - c_hi) > gap else 0)
    return probes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--trials", type=int, default=50)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    n = args.chunk
    rows = {
        "normal": lambda: rng.standard_normal(n),
        "uniform": lambda: rng.random(n),
        "exponential^4 (heavy tail)": lambda: rng.standard_exponential(n) ** 4,
        "50 distinct values (ties)": lambda: rng.integers(0, 50, n).astype(float),
        "stage 2 (top quarter of normal)": lambda: np.sort(rng.standard_normal(4 * n))[-n:],
    }
    print(f"| chunk {n}, k {args.k} | bisect mean | bisect max | secant mean | secant max |")
    print("|---|---|---|---|---|")
    for name, draw in rows.items():
        keys = [ordered_key(draw().astype(np.float32)) for _ in range(args.trials)]
        b = [bisect_probes(key, args.k) for key in keys]
        s = [secant_probes(key, args.k) for key in keys]
        print(f"| {name} | {np.mean(b):.1f} | {max(b)} | {np.mean(s):.1f} | {max(s)} |")


if __name__ == "__main__":
    main()
