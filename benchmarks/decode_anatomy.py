"""A decode step's anatomy at real widths: where one token's time goes on the device and on the host.

Builds a model of a preset's widths and depth with random weights on the device
(``--load-format dummy``, as :mod:`benchmarks.serve_gpu`), starts ``--streams`` requests of
``--input-len`` tokens, and once every one decodes:

1. times ``--steps`` decode steps on the engine thread (:class:`benchmarks.host_overhead.HostClock`:
   time per step, the host's share, the time it waits for the device);
2. traces ``--trace-steps`` more with ``jax.profiler`` (each engine step is an annotated range in
   it) and reduces the trace (:mod:`benchmarks.anatomy`): kernels per step, busy time, idle inside and
   between steps, time and launches by kernel kind.

    python -m benchmarks.decode_anatomy --preset glm52 --layers 78 --quantization int4 -tp 4 \\
        [--streams 1] [--no-async-scheduling] [--suffix -glm52-int4-tp4]

Writes benchmarks/results/decode_anatomy-<gpu><suffix>.md and .json (``--keep-trace``: the trace
beside them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

import jax
from flax import nnx

from benchmarks import anatomy, harness
from benchmarks.host_overhead import HostClock, finish, start_decoding
from benchmarks.serve_gpu import (
    NAMES,
    PRESETS,
    WEIGHTS,
    add_parallel_arguments,
    describe,
    dummy_llm,
    parallelism,
    write_model_dir,
)


def trace_steps(engine, n: int, directory: str) -> str:
    """Run ``n`` engine steps under the profiler; returns the perfetto trace's path."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # host time is HostClock's; Python frames would swamp the trace
    with jax.profiler.trace(directory, create_perfetto_trace=True, profiler_options=options):
        for _ in range(n):
            engine.step()
        jax.block_until_ready(jax.tree.leaves(engine.runner.cache))  # the last launched step ends inside
    found = sorted(pathlib.Path(directory).rglob("perfetto_trace.json.gz"))
    if not found:
        raise SystemExit(f"decode_anatomy: the profiler wrote no perfetto trace under {directory}")
    return str(found[-1])


def token_digest(tokens: list[int]) -> str:
    """A short digest of a token list: runs of the same model and seed that decode the same tokens
    (under other XLA flags, say) show the same digest."""
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> pathlib.Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="glm52")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--quantization", choices=sorted(WEIGHTS), default="dequantize")
    p.add_argument("--overrides", default="{}", help="JSON config overrides (CPU runs use small widths)")
    p.add_argument("--streams", type=int, default=1, help="requests decoding together")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed on the engine thread")
    p.add_argument("--trace-steps", type=int, default=12, help="decode steps traced (the first is skipped)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="layers of one kind under lax.scan (the default) or each traced on its own",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile every step shape first, as the server does (--no-warmup: only the shapes the "
        "workload meets, compiled when first met; quicker for comparing flags)",
    )
    p.add_argument("--device", default="/device:GPU:0", help="the trace's device whose kernels are read")
    p.add_argument("--suffix", default="")
    p.add_argument("--keep-trace", action="store_true", help="copy the perfetto trace beside the results")
    p.add_argument(
        "--num-gpu-experts",
        type=int,
        default=None,
        help="routed experts per layer on the GPUs, the rest in RAM",
    )
    p.add_argument(
        "--disable-shared-experts-fusion",
        action="store_true",
        help="each MoE layer's shared expert apart, not one more routed expert (jaxdsa.shared_experts)",
    )
    add_parallel_arguments(p)
    args = p.parse_args(argv)
    par = parallelism(args)

    began = time.perf_counter()
    work = tempfile.mkdtemp(prefix=f"{args.preset}-anatomy-")
    raw = write_model_dir(work, args.layers, json.loads(args.overrides), args.preset)
    llm = dummy_llm(
        work,
        args,
        max_num_seqs=args.streams,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=args.async_scheduling,
        scan_layers=args.scan_layers,
        num_gpu_experts=args.num_gpu_experts,
        fuse_shared_experts=not args.disable_shared_experts_fusion,
    )
    loaded = time.perf_counter() - began
    joined = sum(
        getattr(getattr(m, "experts", None), "shared_slot", None) is not None
        for _, m in nnx.iter_graph(llm.model)
    )
    engine = llm.engine
    compile_s = engine.warmup(progress=False) if args.warmup else 0.0
    ids = start_decoding(engine, args.streams, args.input_len, max_tokens=args.steps + args.trace_steps + 64)
    timing = HostClock(engine).steps(args.steps)
    trace_dir = tempfile.mkdtemp(prefix="anatomy-trace-")
    trace = trace_steps(engine, args.trace_steps, trace_dir)
    tokens = [int(t) for t in engine.requests[ids[0]].output]
    finish(engine, ids)
    try:
        result = anatomy.anatomy(anatomy.load(trace), device=args.device, skip=1)
        text = anatomy.lines(result)
    except ValueError as e:  # the CPU backend's trace has no device kernels to read
        result = {"error": f"no anatomy: {e}"}
        text = anatomy.lines(result)

    name = f"{NAMES[args.preset]} widths, {args.layers} layers"
    scheduling = "async" if args.async_scheduling else "synchronous"
    lines = harness.report_header(
        f"Decode-step anatomy: {name}",
        {
            "model": f"{name}, random weights (--load-format dummy --quantization {args.quantization})",
            "parallelism": describe(par),
            "workload": f"{args.streams} stream(s) decoding after {args.input_len}-token prompts, "
            f"{scheduling} scheduling",
            "layers": "under lax.scan" if args.scan_layers else "each traced on its own (--no-scan-layers)",
            "routed experts": "all on the GPUs"
            if args.num_gpu_experts is None
            else f"{args.num_gpu_experts} per layer on the GPUs, the others in host RAM (--num-gpu-experts)",
            "shared experts": "apart (--disable-shared-experts-fusion)"
            if args.disable_shared_experts_fusion
            else f"one more routed expert in {joined} MoE module(s) (jaxdsa.shared_experts)",
            "XLA_FLAGS": os.environ.get("XLA_FLAGS") or "(none)",
            "load / compile": f"{loaded:.0f} s / "
            + (f"{compile_s:.0f} s" if args.warmup else "(no warmup: compiled when first met)"),
            "time per step (engine thread)": f"{timing['wall_ms']:.2f} ms over {args.steps} steps "
            f"({1e3 * args.streams / timing['wall_ms']:.1f} tok/s)",
            "host per step": f"{timing['host_ms']:.2f} ms of engine-thread CPU time; launch "
            f"{timing['launch_ms']:.2f} ms, waiting for tokens {timing['blocked_ms']:.2f} ms (wall)",
            "first stream's tokens": f"{len(tokens)}, digest {token_digest(tokens)}",
        },
    )
    lines += [
        f"Trace of {args.trace_steps} steps ({args.device}; the first left out), by benchmarks.anatomy:",
        "",
        "```",
        *text,
        "```",
        "",
        "The kernels that take most time per step (XLA's fusion names; what each holds is in the step's",
        "optimized HLO):",
        "",
        "```",
        *anatomy.name_lines(result),
        "```",
        "",
    ]
    payload = {"timing": timing, "anatomy": result, "tokens": tokens, "config": raw, "args": vars(args)}
    path = harness.write_result("decode_anatomy", "\n".join(lines), suffix=args.suffix, rows=[payload])
    if args.keep_trace:
        shutil.copy(trace, path.with_suffix(".trace.json.gz"))
    shutil.rmtree(trace_dir, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    print(f"decode_anatomy: wrote {path}", file=sys.stderr)
    return path


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
