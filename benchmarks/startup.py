"""Start-up time against depth: dummy load + compiling every step bucket, cold and warm.

Each start runs in a fresh process (nothing compiled in memory). ``cold``: an empty persistent
compilation cache; ``warm``: the cache the cold start of the same model filled. A start is what
``python -m serve --load-format dummy`` does before it answers: parse the config, build the model
abstractly, draw the weights on the device, and compile every (token bucket, step mode) variant.

    python -m benchmarks.startup                       # tiny GLM-5 widths, 4 and 78 layers (CPU)
    python -m benchmarks.startup --widths glm5 --layers 4 78 --max-num-batched-tokens 2048
    python -m benchmarks.startup --widths glm5 --quantization int4 --experts 16 --scan-layers on \
        --layers 78 --suffix=-glm5-int4-78   # GLM-5 widths on one GPU: fewer experts so 78 layers fit

Writes benchmarks/results/startup-<device>.md (and the JSON beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TINY = "glm5"  # a jaxdsa.checkpoints.tiny.presets name


def model_config(widths: str, layers: int, experts: int | None = None) -> dict:
    """config.json of a GLM-5 model at ``layers`` layers: the tiny preset's widths or GLM-5's, with
    ``experts`` routed experts per layer if given (each of GLM-5's width: what one GPU holds of a
    78-layer model is a model with fewer experts, not narrower ones)."""
    if widths == "tiny":
        from jaxdsa.checkpoints.tiny.presets import TINY_PRESETS

        raw = dict(TINY_PRESETS[TINY])
    else:
        from benchmarks.serve_gpu import GLM5

        raw = dict(GLM5)
    raw = {**raw, "num_hidden_layers": layers, "indexer_types": ["full"] * layers}
    if experts is not None:
        raw |= {"n_routed_experts": experts, "n_group": 1, "topk_group": 1}
    return raw


def child(args: argparse.Namespace) -> None:
    """One start in this process; prints one JSON line of phase times."""
    start = time.perf_counter()
    import jax
    from flax import nnx

    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import jaxdsa

    imported = time.perf_counter()
    llm = jaxdsa.LLM(
        args.model_dir,
        dtype=args.dtype,
        load_format="dummy",
        progress=False,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=args.quantization,
        scan_layers=args.scan_layers == "on",
    )
    jax.block_until_ready(nnx.state(llm.model))
    loaded = time.perf_counter()
    engine = llm.engine
    seconds = engine.runner.warmup()  # Engine.warmup without its progress line
    compiled = time.perf_counter()
    variants = len(seconds)
    print(
        json.dumps(
            {
                "import_s": imported - start,
                "load_s": loaded - imported,
                "compile_s": compiled - loaded,
                "total_s": compiled - start,
                "variants": variants,
                "slowest_variant_s": max(seconds.values()),
                "sum_variants_s": sum(seconds.values()),
                "variant_s": {f"T={b} {mode}": round(s, 1) for (b, mode), s in seconds.items()},
            }
        )
    )


def run_start(model_dir: str, cache_dir: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", "--model-dir", model_dir]
    cmd += ["--cache-dir", cache_dir, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd += ["--quantization", args.quantization, "--scan-layers", args.scan_layers]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", choices=["tiny", "glm5"], default="tiny")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 78])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--quantization", default="dequantize", help="dummy weights: dequantize (bf16) | int4 | fp8"
    )
    parser.add_argument("--experts", type=int, help="routed experts per layer (default: the preset's)")
    parser.add_argument("--scan-layers", choices=["on", "off"], default="on", help="LLM(scan_layers=...)")
    parser.add_argument("--suffix", default="", help="results file name suffix")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    began = time.perf_counter()
    rows: list[dict] = []
    path = None
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            model_dir, cache_dir = os.path.join(tmp, f"model{layers}"), os.path.join(tmp, f"cache{layers}")
            os.makedirs(model_dir)
            with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as fh:
                json.dump(model_config(args.widths, layers, args.experts), fh)
            for kind in ("cold", "warm"):  # warm reads what cold wrote
                result = run_start(model_dir, cache_dir, args)
                rows.append({"layers": layers, "start": kind, **result})
                print(f"{layers} layers, {kind}: {result}", file=sys.stderr, flush=True)
                path = write_report(rows, args, time.perf_counter() - began)  # a call cut short keeps these
    print(path)


def _ratio(rows: list[dict], kind: str) -> str:
    """Total start time of the deepest model over the shallowest's, for ``kind`` starts."""
    by_depth = {r["layers"]: r["total_s"] for r in rows if r["start"] == kind}
    if len(by_depth) < 2:
        return "n/a (one depth)"
    return f"{by_depth[max(by_depth)] / by_depth[min(by_depth)]:.2f}x"


def write_report(rows: list[dict], args: argparse.Namespace, wall_s: float):
    """Write the results file (and its JSON) for the starts so far; returns its path."""
    from benchmarks import harness

    lines = harness.report_header(
        f"Start-up against depth ({args.widths} widths, dummy {args.dtype} weights)",
        {
            "weights": f"--quantization {args.quantization}, routed experts per layer "
            f"{args.experts or 'as the preset'}, scan_layers {args.scan_layers}",
            "step variants compiled": f"{rows[0]['variants']} (token buckets x step modes)",
            "engine": f"max_num_batched_tokens {args.max_num_batched_tokens}, "
            f"max_num_seqs {args.max_num_seqs}, max_model_len {args.max_model_len}",
            "deepest / shallowest, cold": _ratio(rows, "cold"),
            "deepest / shallowest, warm": _ratio(rows, "warm"),
            "benchmark wall time": f"{wall_s:.0f} s",
        },
    )
    lines += [
        "Each start is a fresh process: import, dummy load (weights drawn on the device), compile "
        "every step variant. Cold: empty persistent compilation cache; warm: the one cold filled. "
        "The warm-up compiles the variants side by side: slowest_variant_s and sum_variants_s are "
        "the variants' compile times (on a warm start: reading them from the cache); the JSON has each.",
        "",
        harness.markdown_table(
            rows,
            ["layers", "start", "import_s", "load_s", "compile_s", "total_s", "variants"]
            + ["slowest_variant_s", "sum_variants_s"],
        ),
        "",
    ]
    path = harness.write_result("startup", "\n".join(lines), suffix=args.suffix)
    harness.dump_json(str(path.with_suffix(".json")), rows)
    return path


if __name__ == "__main__":
    main()
