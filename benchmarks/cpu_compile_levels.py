"""XLA:CPU's LLVM optimization level against the bundled model's step shapes: compile and step time.

On the CPU the warm-up compiles the engine's steps at one LLVM optimization level
(:func:`jaxdsa.engine.executables.compiler_options`); this is what the choice rests on. For each
level of ``--levels``, every step shape the Quick start server warms (the bundled model, the
server's defaults) is compiled from a fresh lowering with JAX's caches off, one compile at a time
(process CPU seconds: the figure a 2-core cold start divides among its cores). Then each shape's
step runs on padding, the levels taking turns call by call (median of ``--reps``), and the same
prompts (prefill chunks, decode steps) are generated on each level's steps: their tokens and
logprobs must equal the first level's bit for bit.

    python -m benchmarks.cpu_compile_levels [--levels 3,1,0] [--reps 7]

Writes benchmarks/results/cpu_compile_levels-cpu.md and its JSON.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["JAXDSA_COMPILATION_CACHE"] = "0"  # every compile is XLA's own
os.environ["JAXDSA_EXECUTABLE_CACHE"] = "0"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxdsa  # noqa: E402
from benchmarks import harness  # noqa: E402
from jaxdsa.engine import SamplingParams  # noqa: E402
from jaxdsa.engine.executables import CPU_OPTIMIZATION  # noqa: E402
from jaxdsa.serve import default_model  # noqa: E402


def generated(engine, prompts: list[list[int]]) -> str:
    """Each prompt's greedy tokens and their logprobs (top 5), as exact text."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5))
    outputs = []
    while engine.has_unfinished():
        outputs += [(o.request_id, o.new_token_ids, o.logprobs) for o in engine.step()]
    return repr(sorted(outputs, key=lambda o: o[0]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="3,1,0", help="xla_backend_optimization_level values, first = base")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    llm = jaxdsa.LLM(default_model.ensure_default_model(), dtype="float32", enable_prefix_caching=False)
    runner = llm.engine.runner
    executables: dict[int, dict] = {level: {} for level in levels}
    rows = []
    for b, mode in runner.variants:
        batch = runner.packer.padding(b, mode)
        step, step_args = runner._variant(batch, False)
        row = {"tokens": b, "mode": "sparse" if mode.sparse else "dense"}
        for level in levels:
            with runner._precision():
                lowered = runner._compiled(*step).lower(*step_args)
            start = time.process_time()
            executables[level][step] = lowered.compile(compiler_options={CPU_OPTIMIZATION: level})
            row[f"compile_s L{level}"] = time.process_time() - start
        times = {level: [] for level in levels}
        for _ in range(args.reps):
            for level in levels:
                runner._executables[step] = executables[level][step]
                start = time.perf_counter()
                jax.block_until_ready(runner._dispatch(batch, False))
                times[level].append(time.perf_counter() - start)
        row |= {f"step_ms L{level}": 1e3 * float(np.median(times[level][1:])) for level in levels}
        rows.append(row)
        print(row, flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, llm.config.vocab_size, n).tolist() for n in (3, 40, 700)]
    outputs = {}
    for level in levels:
        runner._executables = dict(executables[level])
        outputs[level] = generated(llm.engine, prompts)
    total = {"tokens": "all", "mode": ""}
    total |= {k: sum(r[k] for r in rows) for k in rows[0] if k.startswith("compile_s")}
    lines = harness.report_header(
        "XLA:CPU optimization level: the bundled model's step shapes",
        {
            "model": "the bundled model (python -m serve's defaults: 16 seqs, 512 tokens a step)",
            "machine": f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end",
            "compile_s": "process CPU seconds of one compile (fresh lowering, no caches), one at a time",
            "step_ms": f"a padding step, levels in turn call by call, median of {args.reps - 1}",
            "same outputs": ", ".join(
                f"L{level}: {outputs[level] == outputs[levels[0]]}" for level in levels[1:]
            )
            + f" (greedy tokens and top-5 logprobs of 3 prompts vs L{levels[0]})",
        },
    )
    lines += [harness.markdown_table([*rows, total], list(rows[0]))]
    path = harness.write_result("cpu_compile_levels", "\n".join(lines) + "\n", suffix=args.suffix, rows=rows)
    print("\n".join(lines))
    print(f"cpu_compile_levels: wrote {path}")


if __name__ == "__main__":
    main()
