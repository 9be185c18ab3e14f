"""One core's rate of the host experts' kernel by LLVM's vector width: 256-bit against 512-bit vectors.

On Intel's server cores LLVM prefers 256-bit vectors even where AVX-512 exists (the CPU model's
``prefer-256-bit`` tuning), and :mod:`jaxdsa.offload.cpu_moe` turns that off. This measures what the
change is worth where memory does not hide it: one thread multiplies one expert's ``[D, 512]``
gate|up columns (a preset's D; the codes fit in L2) by ``T`` tokens again and again, the best of
``--calls`` calls per round, each width in a process of its own (Numba's CPU target takes its
features once per process), the widths taking turns for ``--rounds`` rounds so a slow spell of a
shared host falls on both.

    python -m benchmarks.host_vectors [--formats int4,fp8,fp4] [--tokens 1,8] [--rounds 3]

Writes benchmarks/results/host_vectors-<device><suffix>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import numpy as np

from benchmarks import harness
from benchmarks.serve_gpu import PRESETS

COLUMNS = 512
WIDTHS = {"256-bit": "", "512-bit": ",-prefer-256-bit"}  # appended to the host's own features


def measure(fmt: str, tokens: int, d: int, calls: int) -> float:
    """Best seconds of ``calls`` calls of the kernel on one expert, one thread (run in the child)."""
    import numba

    from benchmarks.host_experts import random_weight, timed
    from jaxdsa.offload import cpu_moe

    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    w = cpu_moe.HostWeight.of(random_weight(rng, fmt, 1, d, COLUMNS), None)
    xs = rng.standard_normal((tokens, d)).astype(np.float32)
    args = (xs, np.array([0, tokens], np.int64), np.array([0], np.int64), w, True, COLUMNS)
    cpu_moe.expert_matmul(*args)  # compiles
    return min(timed(cpu_moe.expert_matmul, *args) for _ in range(calls))


def run_width(width: str, cases: list[tuple[str, int]], d: int, calls: int) -> dict:
    """The cases' best seconds in a fresh process compiled for ``width``."""
    from llvmlite import binding

    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
    env["NUMBA_CPU_FEATURES"] = binding.get_host_cpu_features().flatten() + WIDTHS[width]
    code = (
        "import json, sys; from benchmarks.host_vectors import measure; "
        f"print(json.dumps([measure(f, t, {d}, {calls}) for f, t in {cases!r}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return dict(zip(cases, json.loads(out.stdout.strip().splitlines()[-1])))


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="glm52")
    p.add_argument("--formats", default="int4,fp8,fp4")
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    d = PRESETS[args.preset]["hidden_size"]
    cases = [(f, int(t)) for f in args.formats.split(",") for t in args.tokens.split(",")]
    best = {(w, c): float("inf") for w in WIDTHS for c in cases}
    for _ in range(args.rounds):
        for width in WIDTHS:
            for case, seconds in run_width(width, cases, d, args.calls).items():
                best[width, case] = min(best[width, case], seconds)
    rows = []
    for fmt, tokens in cases:
        narrow, wide = best["256-bit", (fmt, tokens)], best["512-bit", (fmt, tokens)]
        rows.append(
            {
                "format": fmt,
                "tokens": tokens,
                "256-bit us": narrow * 1e6,
                "512-bit us": wide * 1e6,
                "256-bit G weights/s": d * COLUMNS / narrow / 1e9,
                "512-bit G weights/s": d * COLUMNS / wide / 1e9,
                "speed-up": narrow / wide,
            }
        )
    from llvmlite import binding

    lines = harness.report_header(
        "Host experts' kernel on one core: 256-bit against 512-bit vectors",
        {
            "host": f"{platform.machine()}, {os.cpu_count()} CPUs, LLVM CPU {binding.get_host_cpu_name()}",
            "work": f"one expert, D = {d} rows x {COLUMNS} columns, bf16 activations, one thread, from cache",
            "timed": f"best of {args.calls} calls x {args.rounds} rounds, the widths in turn",
        },
    )
    lines += [
        "G weights/s: weights decoded and multiplied per second (each token's multiply counts once).",
        "",
        harness.markdown_table(rows, list(rows[0])),
        "",
    ]
    path = harness.write_result("host_vectors", "\n".join(lines), suffix=args.suffix, rows=rows)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
