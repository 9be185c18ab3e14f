"""GPU benchmark: decode sparse MLA over bf16 rows vs ``fp8_ds_mla`` records (native and software e4m3).

Run ``python -m benchmarks.kernels_mla_fp8`` on a GPU. Decode shapes, one query per sequence:
B in {1, 8, 32, 64, 128} x H in {16, 64} x context in {8k, 64k} tokens per sequence, top-k 2048,
576-wide rows (512 latent + 64 rope), bf16 queries, no sink. Each context gets one pool of
``128 * context`` slots (sequence b owns slots ``[b * context, (b + 1) * context)``; 9.7 GB bf16 +
5.5 GB fp8 at 64k), the bf16 rows random normal and the fp8 records their
:func:`pallas_kernels.quant.kv_fp8.quantize_latent`, so both kinds hold the same rows. A query's
indices are 2048 distinct random positions of its own sequence (``top_k`` of random logits).

Per shape three rows, each the kernel with the tuning table's config (``kernel.sparse_mla``'s own
choice): ``bf16`` rows, ``fp8 native`` (the e4m3 cast) and ``fp8 software`` (the integer decode
sm_80 runs, forced with ``fp8_decode="software"``). Each is checked on the first input set against
the float32 reference over the same cache (rel L2 <= 1e-2 on out; the fp8 reference dequantizes
the gathered records), then timed as :mod:`benchmarks.kernels_mla` times (its
:func:`~benchmarks.kernels_mla.compile_and_check`: R input sets back to back in one jit, median of
20 replays). Input set r takes the sequences from ``r * B`` on (modulo 128), so at small B the sets
read different sequences and a replay touches >= 2.5x the 50 MiB L2 (R capped at ``MAX_SETS``:
at B = 1 the fp8 sets then hold 1.3x the L2, the bf16 ones 2.2x; B = 1 times are noisy).

bytes = gathered rows (B * 2048 * 1152 for bf16, * 656 for records) + q + out (bf16) + indices;
``% stream`` is of the memory ceiling measured in the same process (:class:`benchmarks.harness.Ceilings`).
``KERNELS_MLA_FP8_ONLY`` (comma-separated ``ctx=8k H=16 B=1`` labels) limits the shapes;
``KERNELS_MLA_FP8_BUDGET_S`` (default 330) stops starting new shapes after that many seconds (the
rest are listed as skipped). The results file is rewritten after every shape, so a run cut short
keeps what it measured. Writes ``benchmarks/results/kernels_mla_fp8-<gpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.kernels_mla import DV, L2_BYTES, SCALE, TOPK, D, compile_and_check, describe
from pallas_kernels._triton import compute_capability
from pallas_kernels.quant import kv_fp8
from pallas_kernels.sparse_mla import kernel, ref, tuning
from pallas_kernels.sparse_mla.tuning import MlaConfig

SEQS = 128  # sequences per pool: the largest B
CONTEXTS = (8192, 65536)
BATCHES = (1, 8, 32, 64, 128)
HEADS = (16, 64)
MAX_SETS = 48  # each set is one more kernel call to lower (about 0.1 s each)
W = kv_fp8.record_width(DV, D - DV)
IMPLS = {"bf16": None, "fp8 native": "native", "fp8 software": "software"}  # name -> fp8_decode
BUDGET_S = float(os.environ.get("KERNELS_MLA_FP8_BUDGET_S", "330"))
ONLY = [s.strip() for s in os.environ.get("KERNELS_MLA_FP8_ONLY", "").split(",") if s.strip()]


@dataclasses.dataclass(frozen=True)
class Shape:
    context: int
    h: int
    b: int

    @property
    def label(self) -> str:
        return f"ctx={self.context // 1024}k H={self.h} B={self.b}"

    def nbytes(self, row_bytes: int) -> int:
        return self.b * TOPK * row_bytes + self.b * self.h * (D + DV) * 2 + self.b * TOPK * 4

    @property
    def sets(self) -> int:
        return max(1, min(MAX_SETS, math.ceil(2.5 * L2_BYTES / self.nbytes(W))))


SHAPES = [Shape(c, h, b) for c in CONTEXTS for h in HEADS for b in BATCHES]


def _pools(context: int) -> tuple[jax.Array, jax.Array]:
    """bf16 rows ``[SEQS * context, D]`` and their records ``[SEQS * context, W]`` (quantized in chunks,
    so the float32 temporaries stay small)."""
    n = SEQS * context
    rows = jax.jit(lambda k: jax.random.normal(k, (n, D), jnp.bfloat16))(jax.random.key(context))
    chunk = math.gcd(n, 1 << 16)
    quantize = jax.jit(
        lambda r: jax.lax.map(lambda c: kv_fp8.quantize_latent(c, DV), r.reshape(-1, chunk, D)).reshape(-1, W)
    )
    return jax.block_until_ready((rows, quantize(rows)))


@functools.partial(jax.jit, static_argnames=("b", "h", "context"))
def _make_set(key, first, *, b: int, h: int, context: int):
    """q [b, h, D] bf16 and indices [b, TOPK]: 2048 distinct positions of sequences first .. first+b-1."""
    kq, ki = jax.random.split(key)
    q = jax.random.normal(kq, (b, h, D), jnp.bfloat16)
    _, pos = jax.lax.top_k(jax.random.uniform(ki, (b, context)), TOPK)
    seqs = (first + jnp.arange(b, dtype=jnp.int32)) % SEQS
    return q, seqs[:, None] * context + pos.astype(jnp.int32)


_reference = jax.jit(functools.partial(ref.sparse_mla, sm_scale=SCALE, v_dim=DV))


def _kernel_fn(fp8_decode: str | None, config: MlaConfig | None = None) -> Callable:
    return lambda q, idx, kv: kernel.sparse_mla(
        q, kv, idx, sm_scale=SCALE, v_dim=DV, fp8_decode=fp8_decode, config=config
    )


def _config(shape: Shape, records: bool) -> MlaConfig:
    return tuning.choose(
        shape.b, shape.h, TOPK, d_v=DV, d_r=D - DV, itemsize=2, record_width=W if records else None
    )


def run(ceilings: harness.Ceilings | None = None) -> list[dict]:
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    ceilings = ceilings or harness.measure_ceilings()
    print(
        f"kernels_mla_fp8: cc {compute_capability()}, stream {ceilings.stream_gbs:.0f} GB/s [{clock():.0f}s]"
    )
    shapes = [s for s in SHAPES if not ONLY or s.label in ONLY]
    rows: list[dict] = []
    for context in CONTEXTS:
        todo = [s for s in shapes if s.context == context]
        if not todo:
            continue
        pools = dict(zip(("bf16", "fp8"), _pools(context), strict=True))
        print(f"kernels_mla_fp8: pools for {context} tokens ready [{clock():.0f}s]")
        for shape in todo:
            if clock() > BUDGET_S:
                rows += [
                    {"shape": shape.label, "impl": name, "note": "not run: time budget"} for name in IMPLS
                ]
                continue
            keys = jax.random.split(jax.random.key(1000 * shape.h + shape.b), shape.sets)
            sets = [
                _make_set(k, r * shape.b, b=shape.b, h=shape.h, context=context) for r, k in enumerate(keys)
            ]
            q0, idx0 = sets[0]
            wants = {kind: _reference(q0.astype(jnp.float32), kv, idx0) for kind, kv in pools.items()}
            for name, mode in IMPLS.items():
                kind = "bf16" if mode is None else "fp8"
                kv, want = pools[kind], wants[kind]
                row_bytes = W if mode else D * 2
                cfg = _config(shape, records=mode is not None)
                row = {"shape": shape.label, "impl": name, "config": describe(cfg), "sets": len(sets)}
                row["MB"] = shape.nbytes(row_bytes) / 1e6
                fn_sets = [(*s, kv) for s in sets]
                checked, timer = compile_and_check(_kernel_fn(mode), fn_sets, want, shape.b)
                if timer is None and cfg.block_n > 16 and not checked.get("note", "").startswith("FAILED"):
                    # the table's config did not build (shared memory?): keep its error, time half the step
                    rows.append(row | checked)
                    cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
                    row |= {"impl": f"{name} (bn/2)", "config": describe(cfg)}
                    checked, timer = compile_and_check(_kernel_fn(mode, cfg), fn_sets, want, shape.b)
                row |= checked
                if timer:
                    us = timer(20)
                    gbs = shape.nbytes(row_bytes) / (us * 1e-6) / 1e9
                    row |= {"us": us, "GB/s": gbs, "% stream": 100 * gbs / ceilings.stream_gbs}
                rows.append(row)
                print(f"{shape.label} {name}: {row.get('us', row.get('note'))} [{clock():.0f}s]")
            _write_report(rows, ceilings, clock())
    _write_report(rows, ceilings, clock())
    return rows


COLUMNS = ("shape", "impl", "config", "sets", "MB", "us", "GB/s", "% stream", "rel_err", "lse_err", "note")


def _summary(rows: list[dict]) -> list[dict]:
    """One line per shape: each impl's us and % of the memory ceiling, and fp8's speed-up over bf16."""
    by_shape: dict[str, dict] = {}
    for r in rows:
        line = by_shape.setdefault(r["shape"], {"shape": r["shape"]})
        if "us" in r:
            impl = r["impl"].removesuffix(" (bn/2)")
            line[f"{impl} us"] = r["us"]
            line[f"{impl} %"] = r["% stream"]
    for line in by_shape.values():
        for name in ("fp8 native", "fp8 software"):
            if "bf16 us" in line and f"{name} us" in line:
                line[f"bf16/{name.split()[1]}"] = line["bf16 us"] / line[f"{name} us"]
    return list(by_shape.values())


SUMMARY_COLUMNS = (
    "shape",
    "bf16 us",
    "bf16 %",
    "fp8 native us",
    "fp8 native %",
    "fp8 software us",
    "fp8 software %",
    "bf16/native",
    "bf16/software",
)


def _write_report(rows: list[dict], ceilings: harness.Ceilings, elapsed: float) -> None:
    text = "\n".join(
        [
            *harness.report_header(
                f"Sparse MLA decode, bf16 rows vs fp8_ds_mla records (576/512, top-{TOPK}, bf16 q) on "
                f"{harness.device_header()['device']}",
                harness.ceiling_rows(ceilings, elapsed),
            ),
            "Method: see the docstring of `benchmarks/kernels_mla_fp8.py`. `%` is of the memory ceiling;",
            "`bf16/native` is the bf16 time over the fp8 one (above 1: fp8 faster).",
            "",
            "## Summary",
            "",
            harness.markdown_table(_summary(rows), SUMMARY_COLUMNS),
            "",
            "## Every measurement",
            "",
            harness.markdown_table(rows, COLUMNS),
            "",
        ]
    )
    out = harness.write_result("kernels_mla_fp8", text, rows=rows)
    print(f"kernels_mla_fp8: wrote {out}")


if __name__ == "__main__":
    run()
