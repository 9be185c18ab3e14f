"""One device call for the kernel tables docs/results.md quotes, torch peers in the same process.

    python -m benchmarks.gpu_run [--sections mla,indexer,moe,attention,sampler]

JAX's allocator is set to grow on demand (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, capped at
``XLA_PYTHON_CLIENT_MEM_FRACTION``, default 0.75 here) before JAX starts, so torch's caching
allocator keeps about a fifth of the GPU for the peers. The ceilings (JAX and torch: copy,
read-only sum, matmul) are measured once and passed to every section; each section runs in its
own try block and writes its results file when it ends (``JAXDSA_RESULTS`` says where), so a call
cut short keeps what finished. Sweep variants run only where ``KERNELS_MLA_VARIANTS`` /
``KERNELS_INDEXER_VARIANTS`` name them.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
# No sweep variants by default ("none" matches none): the gap variants of 2026-11-23 (fused merge,
# 3 stages, top-k exact exit / ternary search) are decided; KERNELS_*_VARIANTS names new ones.
os.environ.setdefault("KERNELS_MLA_VARIANTS", "none")
os.environ.setdefault("KERNELS_MLA_BUDGET_S", "1e9")
os.environ.setdefault("KERNELS_MLA_SKIP_REFERENCE", "1")
# No indexer sweep and no pure-JAX indexer reference (top-k still times lax.top_k).
os.environ.setdefault("KERNELS_INDEXER_VARIANTS", "none")
os.environ.setdefault("KERNELS_INDEXER_SKIP_REFERENCE", "1")
os.environ.setdefault("KERNELS_INDEXER_BUDGET_S", "1e9")
os.environ.setdefault("MOE_BUDGET_S", "0")
os.environ.setdefault("MOE_REFERENCE_MAX_T", "8")
os.environ.setdefault("MOE_DIAGNOSTICS", "0")

from benchmarks import harness  # noqa: E402  (after the allocator settings)

SECTIONS = ("mla", "indexer", "moe", "attention", "sampler")
# Decode B = 1 / 32 / 128 at every head count and the T = 4096 prefill: the rows docs/kernels.md
# and docs/results.md quote (B = 8 and T = 1024 are left out of this call).
MLA_SHAPES = ",".join(
    [f"decode H={h} B={b}" for h in (16, 64, 128) for b in (1, 32, 128)]
    + [f"prefill H={h} T=4096" for h in (64, 128)]
)


def _section(name: str, ceilings: harness.Ceilings) -> None:
    if name == "mla":
        os.environ.setdefault("KERNELS_MLA_ONLY", MLA_SHAPES)
        from benchmarks import kernels_mla

        kernels_mla.run(ceilings)
    elif name == "indexer":  # top-k (with its variants and torch.topk) first, then the indexer tables
        from benchmarks import kernels_indexer

        kernels_indexer.run(ceilings, ("topk", "decode", "prefill"), torch_peers=True)
    elif name == "moe":
        from benchmarks import moe

        moe.run(ceilings, torch_peers=True)
    elif name == "attention":
        from benchmarks import attention

        attention.run(ceilings, torch_peers=True)
    elif name == "sampler":
        from benchmarks import sampler

        sampler.run(batches=(32,), cases=("top_p 0.95",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    sections = [s.strip() for s in parser.parse_args().sections.split(",") if s.strip()]
    start = time.perf_counter()
    ceilings = harness.measure_ceilings(torch_peers=True)
    print("ceilings:", ceilings.rows(), flush=True)
    for name in sections:
        t0 = time.perf_counter()
        try:
            _section(name, ceilings)
        except Exception:  # noqa: BLE001 - the next section still runs
            traceback.print_exc()
        print(
            f"== {name}: {time.perf_counter() - t0:.0f} s (total {time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
