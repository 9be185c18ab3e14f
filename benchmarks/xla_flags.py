"""XLA flag variants of one decode step, side by side: which flags make the step faster, and do they
change what it computes.

Runs :mod:`benchmarks.decode_anatomy` once per variant, each in its own process (XLA reads
``XLA_FLAGS`` once, when its backend starts) with the variant's flags added to the environment's,
and writes one table: time per step on the engine thread (no profiler), the launch share of it,
the traced anatomy (kernels, busy, idle inside, CUDA graphs launched) and whether the first
stream's greedy tokens equal the first variant's.

    python -m benchmarks.xla_flags --variants base,thunks,all -- \\
        --preset glm52 --layers 20 --quantization int4 -tp 4

Arguments after ``--`` go to every decode_anatomy run. Writes
benchmarks/results/xla_flags-<gpu><suffix>.md and .json, and each variant's decode_anatomy files
(suffix ``<suffix>-<variant>``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import harness
from benchmarks.decode_anatomy import token_digest

# What the traces say (benchmarks/results/decode_anatomy-h200-*): the Pallas-Triton kernels are
# inside XLA's CUDA graphs already; the graphs break at every collective (not a default command
# type in JAX 0.11.2) and at the scan's loop, which runs on the host. A graph's launch costs the host
# about 2-3 us per kernel in it (cuGraphLaunch of a 20-kernel graph ~50 us), so the step's launching
# grows with its kernels. These variants change how XLA builds and launches the graphs: straight-line
# graphs (SERIALIZE) instead of the latency-hiding scheduler's DAG, temporary buffers at fixed
# addresses so fewer graphs need updating (SKIP_TEMP), conditionals, collectives and loops inside the
# graphs (the loops unrolled there), one-kernel graphs, one exclusive user of each GPU; and the loop
# itself: XLA's double buffering of its carried values (addresses that alternate between iterations
# make graphs update) or the whole scan unrolled by XLA; collectives made synchronous (and NCCL's
# rather than XLA's own kernels) so that they can join the graphs.
COMMANDS = "--xla_gpu_enable_command_buffer="
SERIALIZE = "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE"
SKIP_TEMP = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
LOOPS = f"{COMMANDS}+CONDITIONAL,+COLLECTIVES,+WHILE --xla_gpu_command_buffer_unroll_loops=true"
FULL_UNROLL = "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL"
SYNC = (
    "--xla_gpu_disable_async_collectives=ALLREDUCE,ALLGATHER --xla_gpu_experimental_use_collective_kernels="
)
SYNC_COLLECTIVES = f"{COMMANDS}+CONDITIONAL,+COLLECTIVES {SYNC}"
SYNC_LOOPS = f"{COMMANDS}+CONDITIONAL,+COLLECTIVES,+WHILE {SYNC}"
# NCCL's symmetric-memory kernels (NCCL >= 2.27): buffers registered once in every rank's window,
# so a small all-reduce is one kernel of loads and stores over NVLink rather than the LL ring.
NCCL_SYMMETRIC = (
    "--xla_gpu_experimental_enable_nccl_symmetric_buffers=true "
    "--xla_enable_nccl_symmetric_buffers_for_collectives=all"
)
# name -> XLA flags, each optionally prefixed by NAME=VALUE environment settings
VARIANTS: dict[str, str] = {
    "base": "",
    "serialize": SERIALIZE,
    "skip-temp": SKIP_TEMP,
    "conditional": f"{COMMANDS}+CONDITIONAL",
    "loops": LOOPS,
    "loops-serialize-skip": f"{LOOPS} {SERIALIZE} {SKIP_TEMP}",
    "min-graph-1": "--xla_gpu_graph_min_graph_size=1",
    "exclusive": "--xla_gpu_require_exclusive_lock=true",
    "no-double-buffer": "--xla_gpu_enable_while_loop_double_buffering=false",
    "full-unroll": FULL_UNROLL,
    "sync-collectives": SYNC_COLLECTIVES,
    "full-unroll-sync-collectives": f"{FULL_UNROLL} {SYNC_COLLECTIVES}",
    "sync-loops": SYNC_LOOPS,
    "nccl-symmetric": NCCL_SYMMETRIC,
    "nccl-symmetric-sync-loops": f"{NCCL_SYMMETRIC} {SYNC_LOOPS}",
    "one-shot": "--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE",
    "no-graphs": COMMANDS,
}


def run_variant(name: str, flags: str, anatomy_args: list[str], suffix: str, timeout: float) -> dict:
    """One decode_anatomy process under ``flags``; its JSON row, or a note why there is none."""
    env = dict(os.environ)
    words = flags.split()
    env |= dict(w.split("=", 1) for w in words if not w.startswith("--"))
    env["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), *(w for w in words if w.startswith("--"))]
    ).strip()
    cmd = [sys.executable, "-m", "benchmarks.decode_anatomy", *anatomy_args, f"--suffix={suffix}-{name}"]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": name, "flags": flags, "note": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - began
    sys.stderr.write(proc.stderr[-4000:])
    written = [
        line.split("wrote ", 1)[1] for line in proc.stderr.splitlines() if "decode_anatomy: wrote" in line
    ]
    if proc.returncode or not written:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {
            "variant": name,
            "flags": flags,
            "note": f"exit {proc.returncode}: {tail[:160]}",
            "wall_s": wall,
        }
    with open(written[0].replace(".md", ".json"), encoding="utf-8") as fh:
        row = json.load(fh)["rows"][0]
    return {"variant": name, "flags": flags, "wall_s": wall, **row}


def summarize(run: dict, reference_tokens: list[int] | None) -> dict:
    """One table row of a variant's decode_anatomy payload."""
    if "timing" not in run:
        return {"variant": run["variant"], "flags": run["flags"] or "(none)", "note": run.get("note", "")}
    t, a = run["timing"], run["anatomy"]
    host = a.get("host") or {}
    tokens = run.get("tokens", [])
    same = "" if reference_tokens is None else tokens == reference_tokens
    return {
        "variant": run["variant"],
        "flags": run["flags"] or "(none)",
        "ms/step": t["wall_ms"],
        "launch ms": t["launch_ms"],
        "kernels/step": a.get("launches_per_step", ""),
        "busy ms": a.get("busy_ms", ""),
        "idle inside ms": a.get("idle_inside_ms", ""),
        "graphs/step": host.get("graph_launches", ""),
        "kernels/graph": a.get("graph_nodes", ""),
        "graph us": host.get("graph_launch_us", ""),
        "updates/step": host.get("graph_updates", ""),
        "traced launch ms": host.get("launch_ms", ""),
        "cond wait ms": host.get("conditional_wait_ms", ""),
        "tokens": f"{token_digest(tokens)}" + ("" if same == "" else (" equal" if same else " DIFFER")),
        "note": "",
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, anatomy_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="base,serialize", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--suffix", default="")
    p.add_argument("--timeout", type=float, default=400, help="seconds per variant")
    args = p.parse_args(ours)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")

    runs = []
    for name in names:  # the table is rewritten after each variant: a cut-off run keeps what it has
        runs.append(run_variant(name, VARIANTS[name], anatomy_args, args.suffix, args.timeout))
        text, path = write_table(runs, anatomy_args, args.suffix)
    print(text)
    print(f"xla_flags: wrote {path}", file=sys.stderr)


def write_table(runs: list[dict], anatomy_args: list[str], suffix: str):
    """The results file of the variants run so far: ``(its text, its path)``."""
    reference = next((r.get("tokens") for r in runs if "tokens" in r), None)
    rows = [summarize(r, reference if r.get("tokens") is not reference else None) for r in runs]
    columns = ["variant", "ms/step", "launch ms", "kernels/step", "busy ms", "idle inside ms", "graphs/step"]
    columns += ["kernels/graph", "graph us", "updates/step", "traced launch ms", "cond wait ms"]
    lines = harness.report_header(
        "XLA flag variants of a decode step",
        {
            "decode_anatomy arguments": " ".join(anatomy_args) or "(defaults)",
            "XLA_FLAGS in the environment": os.environ.get("XLA_FLAGS") or "(none)",
        },
    )
    lines += [
        "Each variant is one process running benchmarks.decode_anatomy with the variant's flags added to",
        "XLA_FLAGS (its NAME=VALUE words set in the environment). ms/step: the engine thread's time per",
        "decode step, no profiler; launch ms: of it, the time the step's launch took to return; kernels,",
        "busy, idle inside and CUDA graphs: from a trace of further steps (the profiler slows the step);",
        "graph us: the host's time per graph launch; traced launch ms: the launch thread's time per step;",
        "cond wait ms: of it, waiting on the device for a conditional's predicate.",
        "tokens: the first stream's greedy tokens (digest), against the first variant's.",
        "",
        harness.markdown_table(rows, [*columns, "tokens", "flags", "note"]),
        "",
    ]
    text = "\n".join(lines)
    return text, harness.write_result("xla_flags", text, suffix=suffix, rows=rows)


if __name__ == "__main__":
    main()
