"""Run chosen kernels once each inside a CUDA profiler range, for Nsight Compute.

The timing scripts say how fast a kernel is; this one lets ``ncu`` say why. Each case compiles
and warms up outside the range, then runs once inside ``cuProfilerStart``/``cuProfilerStop``, so
``--profile-from-start off`` captures exactly one launch of each kernel the case runs:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section LaunchStats --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python -m benchmarks.profile_kernels mla_h64_b32 topk_4096x131072

Without ncu it prints each case's kernel time from the harness's method, so a run can be
checked before it is profiled. Shapes are the benchmark scripts' (anchor shapes, bf16; the
``moe_int4_*`` / ``moe_fp4_*`` cases: :mod:`benchmarks.quant`'s random 4-bit experts at GLM-5 shapes).
``--summarize NCU_LOG`` turns the saved ncu output into one markdown row per kernel (case,
duration, registers, spills, occupancy, throughputs, issue stalls).

Where a kernel is bound by issuing instructions rather than by memory, the question is which
instructions: add ``--section SourceCounters -o REPORT`` to the ncu command, export the SASS with
``ncu -i REPORT.ncu-rep --page source --print-source sass --csv > sass.csv``, and
``--summarize NCU_LOG --sass sass.csv`` adds one row per kernel with its executed warp instructions
split by kind (:data:`SASS_KINDS`), the most executed opcodes and the most sampled stall reasons.
(With ``-o`` ncu prints no metrics; ``ncu -i REPORT.ncu-rep`` prints them in the same text form,
to append to the log.) ``--out SUFFIX`` also writes the tables to
``benchmarks/results/profile-<gpu>SUFFIX.md`` under the device / versions / commit header.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import functools
import io
import pathlib
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks import harness, kernels_indexer, kernels_mla, moe, quant
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
        args = kernels_indexer._paged_inputs(
            jax.random.key(3),
            heads=heads,
            s=s,
            batch=kernels_indexer.BATCH,
            t=kernels_indexer.BATCH,
            fp8=False,
        )
        return ikernel.indexer_logits_paged, args

    return build


def _moe(t: int) -> Callable[[], tuple[Callable, tuple]]:
    def build():
        experts = moe._make_weights(jax.random.key(4))
        x, ids, w = moe._make_inputs(jax.random.key(5), t)
        return (lambda x, ids, w, e: mkernel.moe_experts(x, ids, w, e)), (x, ids, w, experts)

    return build


def _moe_quantized(fmt: str, t: int) -> Callable[[], tuple[Callable, tuple]]:
    """Routed experts with random ``fmt`` weights (:func:`benchmarks.quant.random_weight`), GLM-5 shapes."""

    def build():
        key = jax.random.key(6)
        shapes = quant.GLM5
        d, n = shapes.hidden, shapes.expert_width
        experts = {
            "gate_up": quant.random_weight(jax.random.fold_in(key, 0), fmt, (shapes.experts,), d, 2 * n),
            "down": quant.random_weight(jax.random.fold_in(key, 1), fmt, (shapes.experts,), n, d),
        }
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
    **{f"moe_{fmt}_t{t}": _moe_quantized(fmt, t) for fmt in ("int4", "fp4") for t in (1, 32, 512, 4096)},
}


def _profiler(name: str) -> Callable[[], None]:
    """``cuProfilerStart``/``Stop`` from the driver (present wherever a CUDA GPU is); no-op elsewhere."""
    try:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except OSError:
        return lambda: None
    return lambda: fn()


# ncu details-page metric name -> summary column
_METRICS = {
    "Duration": "duration",
    "Registers Per Thread": "regs",
    "Local Memory Spilling Requests": "spill requests",
    "Dynamic Shared Memory Per Block": "smem/block",
    "Theoretical Occupancy": "occupancy % (theor.)",
    "Achieved Occupancy": "occupancy % (achieved)",
    "DRAM Throughput": "DRAM % of peak",
    "Compute (SM) Throughput": "SM % of peak",
    "Warp Cycles Per Issued Instruction": "cycles / issue",
}
_KERNEL = re.compile(r"^  (\S.*) \((\d+, \d+, \d+)\)x\((\d+), \d+, \d+\), Context ")
_METRIC = re.compile(r"^    (\S.*?)\s{2,}(\S+(?:/\S+)?)?\s+([\d,.]+)$")
_CASE = re.compile(r"^profile_kernels: (\S+):")
_PROFILING = re.compile(r'^==PROF== Profiling "')


def summarize(log: str) -> list[dict]:
    """One row per profiled kernel of an ncu text log written by this script."""
    lines = log.splitlines()
    case_of, launched = [], 0  # case name of each profiled launch, in order
    for line in lines:
        if _PROFILING.match(line):
            launched += 1
        elif m := _CASE.match(line):
            case_of += [m.group(1)] * (launched - len(case_of))
    rows: list[dict] = []
    for line in lines:
        if m := _KERNEL.match(line):
            name = re.sub(r"^void |<.*$|\(.*$", "", m.group(1))  # C++ kernels: drop templates and arguments
            rows.append(
                {
                    "case": case_of[len(rows)] if len(rows) < len(case_of) else "?",
                    "kernel": name,
                    "grid": m.group(2).replace(" ", ""),
                    "threads": int(m.group(3)),
                }
            )
        elif rows and (m := _METRIC.match(line)) and m.group(1) in _METRICS:
            unit, value = m.group(2) or "", m.group(3).replace(",", "")
            key = _METRICS[m.group(1)]
            if key in rows[-1]:
                continue  # the same metric printed by two sections
            rows[-1][key] = (
                f"{value} {unit}".strip() if unit and unit not in ("%", "register/thread", "cycle") else value
            )
    return rows


# SASS opcode (the mnemonic before its first '.') -> kind, for the instruction mix of --sass
SASS_KINDS = {
    "shared-memory loads / stores": ("LDS", "LDSM", "STS", "ATOMS"),
    "global loads / async copies": ("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "STG", "UTMALDG", "SYNCS", "RED"),
    "tensor cores": ("HMMA", "HGMMA", "WARPGROUP", "IMMA"),
    "bit ops / packed 16-bit math": (
        "PRMT", "LOP3", "SHF", "HFMA2", "HMUL2", "HADD2", "F2FP", "I2F", "F2F", "I2FP",
    ),
    "integer / address / moves": (
        "IMAD", "IADD3", "VIADD", "IADD", "LEA", "MOV", "SEL", "ISETP", "IABS", "LDC", "S2R", "S2UR", "CS2R",
        "UIADD3", "UMOV", "ULEA", "USHF", "USEL", "UISETP", "ULDC", "UIMAD", "ULOP3", "UPRMT", "R2UR",
    ),
    "float32 math": ("FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "FSETP", "FSEL", "FCHK"),
}  # fmt: skip
_KIND_OF = {op: kind for kind, ops in SASS_KINDS.items() for op in ops}


def _mnemonic(source: str) -> str:
    """``'@P2 LDS.U8 R50, [R60]'`` -> ``'LDS.U8'`` (its opcode is the part before the first '.')."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].rstrip(",") if words else ""


def summarize_sass(text: str, cases: list[str] | None = None) -> list[dict]:
    """One row per kernel of ncu's ``--page source --print-source sass --csv`` export: executed warp
    instructions, their split by :data:`SASS_KINDS` (percent), the top opcodes (with their full
    mnemonics) and the top sampled stall reasons. ``cases``: the case of each kernel, in order."""
    sections = re.split(r'^"Kernel Name","([^"]*)",?\s*$', text, flags=re.M)
    rows = []
    for name, body in zip(sections[1::2], sections[2::2]):
        table = list(csv.reader(io.StringIO(body.strip())))
        if len(table) < 2:
            continue
        header, lines = table[0], table[1:]
        src, execd = header.index("Source"), header.index("Instructions Executed")
        stall_cols = [i for i, h in enumerate(header) if h.startswith("stall_") and "(" not in h]
        by_kind, by_op, stalls = collections.Counter(), collections.Counter(), collections.Counter()
        for line in lines:
            if len(line) <= execd or not line[src].strip():
                continue
            count = int(line[execd].replace(",", "") or 0)
            mnemonic = _mnemonic(line[src])
            by_kind[_KIND_OF.get(mnemonic.split(".")[0], "other")] += count
            by_op[mnemonic] += count
            for i in stall_cols:
                stalls[header[i].removeprefix("stall_")] += int(line[i].replace(",", "") or 0)
        total = sum(by_kind.values())
        sampled = sum(stalls.values()) or 1
        row = {"case": cases[len(rows)] if cases and len(rows) < len(cases) else "?", "kernel": name}
        row["warp instructions"] = total
        row |= {kind: round(100 * by_kind[kind] / max(total, 1), 1) for kind in (*SASS_KINDS, "other")}
        row["top opcodes (% of instructions)"] = ", ".join(
            f"{op} {100 * c / max(total, 1):.1f}" for op, c in by_op.most_common(6)
        )
        row["top stalls (% of samples)"] = ", ".join(
            f"{k} {100 * v / sampled:.0f}" for k, v in stalls.most_common(4)
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="*", choices=sorted(CASES))
    p.add_argument(
        "--summarize", metavar="NCU_LOG", help="print a markdown summary of a saved ncu log and exit"
    )
    p.add_argument("--sass", metavar="SASS_CSV", help="with --summarize: also the instruction mix per kernel")
    p.add_argument(
        "--out", metavar="SUFFIX", help="with --summarize: also write results/profile-<gpu>SUFFIX.md"
    )
    args = p.parse_args(argv)
    if args.summarize:
        rows = summarize(pathlib.Path(args.summarize).read_text())
        text = harness.markdown_table(rows, ["case", "kernel", "grid", "threads", *_METRICS.values()])
        if args.sass:
            mix = summarize_sass(pathlib.Path(args.sass).read_text(), [r["case"] for r in rows])
            text += "\n\n" + harness.markdown_table(mix, list(mix[0]) if mix else ["case"])
        print(text)
        if args.out is not None:
            head = harness.report_header(
                "Nsight Compute profile", {"cases": ", ".join(dict.fromkeys(r["case"] for r in rows))}
            )
            print(harness.write_result("profile", "\n".join(head) + "\n" + text + "\n", args.out))
        return
    if not args.cases:
        p.error("name at least one case (or --summarize NCU_LOG)")
    start, stop = _profiler("cuProfilerStart"), _profiler("cuProfilerStop")
    for name in args.cases:
        fn, inputs = CASES[name]()
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(*inputs))  # compile + warm-up, outside the range
        us = harness.median_seconds(lambda jitted=jitted, inputs=inputs: jitted(*inputs), 1, 5) * 1e6
        start()
        jax.block_until_ready(jitted(*inputs))
        stop()
        print(f"profile_kernels: {name}: {us:.1f} us per call (one input set, L2-warm)", flush=True)
        del inputs


if __name__ == "__main__":
    main()
