"""Host time per decode step: what the engine spends outside the device on each step, and whether
it grows with the model's depth.

A step's wall time on the engine thread splits into the time it waits for the device and the
host's own work: scheduling, packing the buffers, the jitted call's dispatch (on a GPU, launching
every kernel), processing outputs. Under async scheduling the host's work overlaps the device's,
and the device waits for the host only where that work is longer than a step.
:class:`HostClock` measures it on any engine as the engine thread's CPU time (``time.thread_time``:
a thread that waits, for a step's tokens or for a buffer the step before still uses, spends none;
XLA runs computations on threads of its own), beside the wall time and the time spent waiting for
a step's tokens. This script runs it on tiny-width GLM-5.2 models on the CPU at several depths
(every depth the same widths) and writes the results file:

    python -m benchmarks.host_overhead [--layers 4,78] [--batch 8] [--steps 100] [--repeats 5]
        [--no-async-scheduling] [--model DIR] [-tp N]

``-tp N`` runs each model on an N-device mesh (on the CPU:
``XLA_FLAGS=--xla_force_host_platform_device_count=N``), where every host buffer a step sends is
placed on each device.

Target (the host-side decode issue): host time per step at 78 layers <= 1.2 x that at 4.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import jax

import jaxdsa
from benchmarks import harness
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine import Engine, SamplingParams

# GLM-5.2's layer pattern (an indexed layer, then three that reuse its top-k)
KINDS = ("full", "shared", "shared", "shared")


class HostClock:
    """Wall time and device-wait time of an engine's steps. While active, the runner's ``fetch``
    first waits for the step's tokens (timed as blocked) and its ``launch`` is timed as dispatch
    (packing, penalty seats and the jitted call)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.blocked = self.dispatch = 0.0

    @contextlib.contextmanager
    def active(self):
        runner = self.engine.runner
        fetch, launch = runner.fetch, runner.launch

        def timed_fetch(flight):
            start = time.perf_counter()
            jax.block_until_ready(flight.sampled)
            self.blocked += time.perf_counter() - start
            return fetch(flight)

        def timed_launch(*args, **kwargs):
            start = time.perf_counter()
            try:
                return launch(*args, **kwargs)
            finally:
                self.dispatch += time.perf_counter() - start

        runner.fetch, runner.launch = timed_fetch, timed_launch
        try:
            yield self
        finally:
            runner.fetch, runner.launch = fetch, launch

    def steps(self, n: int) -> dict[str, float]:
        """Run ``n`` steps; per step in ms: wall, host (the engine thread's CPU time), waiting for
        a step's tokens, and the wall time of launching (packing and the jitted call)."""
        self.blocked = self.dispatch = 0.0
        with self.active():
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(n):
                self.engine.step()
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        ms = lambda s: 1e3 * s / n  # noqa: E731
        return {
            "wall_ms": ms(wall),
            "host_ms": ms(cpu),
            "blocked_ms": ms(self.blocked),
            "launch_ms": ms(self.dispatch),
        }


def start_decoding(engine: Engine, batch: int, prompt_len: int, max_tokens: int) -> list[str]:
    """``batch`` requests of ``prompt_len`` tokens, stepped until every one is decoding."""
    vocab = engine.cfg.vocab_size
    ids = [f"decode-{time.monotonic_ns()}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = [(7 * i + 13 * j + 1) % vocab for j in range(prompt_len)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while any(len(engine.requests[r].output) < 2 for r in ids):
        engine.step()
    return ids


def finish(engine: Engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def decode_ms(llm: jaxdsa.LLM, batch: int, steps: int) -> float:
    """Milliseconds per step over ``steps`` decode steps of ``batch`` running requests."""
    ids = start_decoding(llm.engine, batch, 4, steps + 16)
    ms = HostClock(llm.engine).steps(steps)["wall_ms"]
    finish(llm.engine, ids)
    return ms


def measure(llm: jaxdsa.LLM, batch: int, steps: int, repeats: int) -> dict[str, float]:
    """Median per-step figures over ``repeats`` runs of ``steps`` decode steps of ``batch`` streams."""
    engine = llm.engine
    engine.warmup(progress=False)
    finish(engine, start_decoding(engine, batch, 4, 32))  # compile anything warm-up left out
    runs = []
    for _ in range(repeats):
        ids = start_decoding(engine, batch, 4, steps + 16)
        runs.append(HostClock(engine).steps(steps))
        finish(engine, ids)
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def tiny_glm52(directory: str, layers: int) -> str:
    kinds = [KINDS[i % len(KINDS)] for i in range(layers)]
    return make_tiny(
        "glm_moe_dsa",
        directory,
        seed=7,
        preset="glm52",
        overrides={"num_hidden_layers": layers, "indexer_types": kinds},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,78", help="depths of tiny GLM-5.2 models to compare")
    parser.add_argument("--model", help="a checkpoint directory instead (one depth)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--suffix", default="")
    args = parser.parse_args()
    models = {}
    if args.model:
        models[args.model] = args.model
    else:
        for layers in map(int, args.layers.split(",")):
            models[f"{layers} layers"] = tiny_glm52(tempfile.mkdtemp(prefix=f"glm52-{layers}-"), layers)
    rows = []
    for name, path in models.items():
        llm = jaxdsa.LLM(
            path,
            dtype="float32",
            page_size=8,
            progress=False,
            max_model_len=256,
            max_num_seqs=args.batch,
            async_scheduling=args.async_scheduling,
            tp=args.tensor_parallel_size,
        )
        rows.append({"model": name, **measure(llm, args.batch, args.steps, args.repeats)})
        print(rows[-1], flush=True)
    lines = harness.report_header(
        "Host time per decode step",
        {
            "models": "tiny-width GLM-5.2 (jaxdsa.checkpoints.make_tiny preset glm52), float32",
            "workload": f"{args.batch} streams decoding, {args.steps} steps x {args.repeats} (median)",
            "scheduling": "async" if args.async_scheduling else "synchronous",
            "devices": f"{len(jax.devices())} x {jax.devices()[0].platform}, -tp {args.tensor_parallel_size}",
        },
    )
    lines += [
        "wall = engine.step() time; host = the engine thread's CPU time (scheduling, packing, dispatch,",
        "outputs); blocked = waiting for a step's tokens; launch = runner.launch's wall time (packing,",
        "penalty seats, the jitted call, and any wait for buffers the step before still uses).",
        "",
        harness.markdown_table(rows, list(rows[0])),
    ]
    if len(rows) > 1:
        ratio = rows[-1]["host_ms"] / rows[0]["host_ms"]
        lines += ["", f"Host time per step, {rows[-1]['model']} / {rows[0]['model']}: {ratio:.2f}x"]
    path = harness.write_result("host_overhead", "\n".join(lines) + "\n", suffix=args.suffix, rows=rows)
    print("\n".join(lines))
    print(f"host_overhead: wrote {path}")


if __name__ == "__main__":
    main()
