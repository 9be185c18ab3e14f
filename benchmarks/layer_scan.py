"""Decode step time with layers scanned and unrolled: what running the layers under ``lax.scan`` costs.

Scanned layers compile once whatever the depth (``jaxdsa.models.layer_groups``), but a Pallas kernel
is an XLA custom call: if it receives a slice of a stacked weight, XLA materializes that slice (a
copy of the layer's weights) every step. This times the same model both ways through the public
API, so it shows that cost, or its absence, on any commit:

    python -m benchmarks.layer_scan --widths glm5 --layers 6 --quantization int4 --batch 1 8

For each ``scan_layers`` setting a fresh ``jaxdsa.LLM`` with dummy weights runs ``--steps`` decode
steps per batch size (:func:`benchmarks.host_overhead.decode_ms`; a first untimed run compiles).
Writes benchmarks/results/layer_scan-<device>.md (and the JSON beside it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import tempfile
import time


def measure(model_dir: str, scan: bool, args: argparse.Namespace) -> list[dict]:
    """Milliseconds per decode step at each batch size, layers scanned or not."""
    import jax
    from flax import nnx

    import jaxdsa
    from benchmarks.host_overhead import decode_ms

    llm = jaxdsa.LLM(
        model_dir,
        dtype="bfloat16",
        load_format="dummy",
        progress=False,
        max_model_len=256,
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=256,
        quantization=args.quantization,
        scan_layers=scan,
    )
    jax.block_until_ready(nnx.state(llm.model))
    rows = []
    for batch in args.batch:
        began = time.perf_counter()
        decode_ms(llm, batch, 2)  # compiles this batch's prefill and decode buckets
        compile_s = time.perf_counter() - began
        ms = min(decode_ms(llm, batch, args.steps) for _ in range(args.repeats))
        rows.append({"scan_layers": scan, "batch": batch, "decode_ms": ms, "first_steps_s": compile_s})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    del llm
    gc.collect()
    return rows


def main(argv: list[str] | None = None) -> pathlib.Path:
    """Time both settings and write the results file; returns its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", choices=["tiny", "glm5"], default="tiny")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, help="routed experts per layer (default: the preset's)")
    parser.add_argument(
        "--quantization", default="dequantize", help="dummy weights: dequantize (bf16) | int4 | fp8"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--suffix", default="", help="results file name suffix")
    args = parser.parse_args(argv)

    from benchmarks import harness
    from benchmarks.startup import model_config
    from jaxdsa import ops

    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(model_config(args.widths, args.layers, args.experts), fh)
        rows = measure(tmp, False, args) + measure(tmp, True, args)
    unrolled = {r["batch"]: r["decode_ms"] for r in rows if not r["scan_layers"]}
    for r in rows:
        r["vs_unrolled"] = r["decode_ms"] / unrolled[r["batch"]]
    lines = harness.report_header(
        f"Decode step, layers scanned vs unrolled ({args.widths} widths, {args.layers} layers)",
        {
            "kernels": ops.get_kernels(),
            "weights": f"dummy, --quantization {args.quantization}, routed experts per layer "
            f"{args.experts or 'as the preset'}",
            "timing": f"min over {args.repeats} runs of {args.steps} decode steps (engine.step, host incl.)",
            "benchmark wall time": f"{time.perf_counter() - began:.0f} s",
        },
    )
    lines += [
        harness.markdown_table(rows, ["scan_layers", "batch", "decode_ms", "vs_unrolled", "first_steps_s"]),
        "",
    ]
    path = harness.write_result("layer_scan", "\n".join(lines), suffix=args.suffix)
    harness.dump_json(str(path.with_suffix(".json")), rows)
    return path


if __name__ == "__main__":
    print(main())
