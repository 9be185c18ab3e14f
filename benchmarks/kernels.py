"""Every DSA hot-path kernel on this GPU in one run, against the pure-JAX references.

Measures the copy and matmul ceilings once, then runs the sparse-MLA / merge benchmark
(:mod:`benchmarks.kernels_mla`) and the indexer / top-k benchmark (:mod:`benchmarks.kernels_indexer`)
with those ceilings: correctness at real shapes (bf16 against a float32 reference), timings of
the tuned kernels and the references, and a tuning sweep within each script's time budget.
Each writes its own table; this script joins them into ``benchmarks/results/kernels-<gpu>.md``.
The MoE expert kernel has its own run: ``python -m benchmarks.moe``.

    python -m benchmarks.kernels
"""

from __future__ import annotations

from benchmarks import harness, kernels_indexer, kernels_mla


def main() -> None:
    ceilings = harness.measure_ceilings()
    print(f"kernels: stream {ceilings.stream_gbs:.0f} GB/s, matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    kernels_mla.run(ceilings)
    kernels_indexer.run(ceilings)
    slug = harness.gpu_slug()
    parts = [(harness.RESULTS / f"kernels_{name}-{slug}.md").read_text() for name in ("mla", "indexer")]
    out = harness.write_result("kernels", "\n\n".join(parts))
    print(f"kernels: wrote {out}")


if __name__ == "__main__":
    main()
