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

# Pallas-Triton kernels are XLA custom calls (``__gpu$xla.gpu.triton``) that XLA's HLO-level command
# buffer pass leaves out of its CUDA graphs (jax-ml/jax#27988), so the graphs break at every kernel.
# The ways around it are all missing from JAX 0.11.2 (benchmarks/results/xla_flags-h200-*.md): the
# allow-list flag of #27988 and XLA's thunk-level pass flag are unknown flags there, and jaxlib's
# command-buffer-compatible Triton FFI call has no switch (JAX 0.11.1 had USE_NEW_CUSTOM_CALL).
# The variants stay so that a newer JAX can be measured the same way.
COMMANDS = "--xla_gpu_enable_command_buffer="
DEFAULT_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
ALL_COMMANDS = f"{COMMANDS}{DEFAULT_COMMANDS},COLLECTIVES,WHILE,CONDITIONAL"  # a scan becomes one graph
TRITON_GRAPHS = "--legacy_command_buffer_custom_call_targets=__gpu$xla.gpu.triton"
THUNKS = "--xla_gpu_experimental_enable_command_buffer_on_thunks=true"
# name -> XLA flags, each optionally prefixed by NAME=VALUE environment settings
VARIANTS: dict[str, str] = {
    "base": "",
    "triton-graphs": TRITON_GRAPHS,
    "thunks": THUNKS,
    "thunks-all": f"{THUNKS} {ALL_COMMANDS}",
    "all": ALL_COMMANDS,
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
        "tokens": f"{token_digest(tokens)}" + ("" if same == "" else (" equal" if same else " DIFFER")),
        "note": "",
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, anatomy_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--variants", default="base,triton-graphs", help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
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
        "busy, idle inside and CUDA graphs: from a trace of further steps (the profiler slows the step).",
        "tokens: the first stream's greedy tokens (digest), against the first variant's.",
        "",
        harness.markdown_table(rows, [*columns, "tokens", "flags", "note"]),
        "",
    ]
    text = "\n".join(lines)
    return text, harness.write_result("xla_flags", text, suffix=suffix, rows=rows)


if __name__ == "__main__":
    main()
