"""Tensor / expert / data parallelism of a GLM-5-shaped model across the GPUs of one host.

The same random GLM-5-shaped model (real widths, one seed: ``--load-format dummy`` draws
identical weights for every layout) runs single-GPU and at each (tp, ep[, dp, dp attention])
layout.

- Correctness in float32 (3 dense + 1 MoE layer, which one H200 holds in float32): prefill logits
  against the single-GPU logits, relative L2 <= 1e-3, and identical greedy tokens. In bf16 this
  comparison is not a test: router top-k choices flip under bf16 rounding and a random model
  amplifies them (on one device bf16 vs float32 already differs by tens of percent), so the
  bf16 difference is reported next to that single-device bf16-vs-float32 noise floor.
- Decode throughput in bf16 (3 dense + 2 MoE layers) through the engine at several batch sizes.

Writes benchmarks/results/multi-gpu-<gpu>x<n>.md.

    python -m benchmarks.multi_gpu [--layouts 1,1 2,1 2,2 1,4,4,attn]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time

import jax
import numpy as np

import jaxdsa
from benchmarks import harness
from benchmarks.serve_gpu import write_model_dir

TOLERANCE = 1e-3  # float32 with HIGHEST matmul precision; only reduction orders differ


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    n = len(jax.devices())
    default = (
        ["1,1"]
        + [f"{t},{e}" for t, e in ((2, 1), (2, 2), (4, 1), (4, 4)) if t <= n]
        + [f"1,{g},{g},attn" for g in (2, 4) if g <= n]
    )
    p.add_argument(
        "--layouts",
        nargs="+",
        default=default,
        help="tp,ep[,dp[,attn]]: attn = dp attention (the dp groups share the experts)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=4,
        help="bf16 model layers (4 = the float32 model, giving the noise floor)",
    )
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    f32_dir, bf16_dir = tempfile.mkdtemp(prefix="glm5-f32-"), tempfile.mkdtemp(prefix="glm5-bf16-")
    write_model_dir(f32_dir, 4)
    write_model_dir(bf16_dir, args.layers)
    prompt = np.random.default_rng(0).integers(0, 512, args.prompt_len).tolist()
    batches = [int(b) for b in args.batches.split(",")]
    rel = lambda a, b: float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max())  # noqa: E731
    rows, base = [], {}

    def load(directory, dtype, par):
        return jaxdsa.LLM(
            directory,
            dtype,
            **par,
            load_format="dummy",
            max_model_len=512,
            max_num_seqs=max(batches),
            max_num_batched_tokens=256,
            progress=False,
        )

    for layout in args.layouts:
        fields = layout.split(",")
        par = {
            "tp": int(fields[0]),
            "ep": int(fields[1]),
            "dp": int(fields[2]) if len(fields) > 2 else 1,
            "dp_attention": fields[3:] == ["attn"],
        }
        start = time.perf_counter()
        llm = load(f32_dir, "float32", par)
        logits, tokens = llm.score(prompt), llm.generate([prompt], max_new_tokens=8)[0]
        del llm
        gc.collect()
        base.setdefault("f32", (logits, tokens))
        row = {
            **par,
            "f32 max rel-L2 vs 1 GPU": rel(logits, base["f32"][0]),
            "f32 greedy equal": tokens == base["f32"][1],
        }
        row["ok"] = row["f32 max rel-L2 vs 1 GPU"] <= TOLERANCE and row["f32 greedy equal"]
        llm = load(bf16_dir, "bfloat16", par)
        logits = llm.score(prompt)
        base.setdefault("bf16", logits)
        row["bf16 rel-L2 vs 1 GPU"] = rel(logits, base["bf16"])
        for b in batches:
            prompts = [prompt] * b
            llm.generate(prompts, max_new_tokens=args.new_tokens)  # compile every bucket the timed run meets
            t0 = time.perf_counter()
            llm.generate(prompts, max_new_tokens=args.new_tokens)
            row[f"bf16 B={b} tok/s"] = b * args.new_tokens / (time.perf_counter() - t0)
        row["s"] = time.perf_counter() - start
        print(row, flush=True)
        rows.append(row)
        del llm
        gc.collect()
        noise = rel(base["bf16"], base["f32"][0]) if args.layers == 4 else float("nan")
        _write(rows, args, noise, n)
    return 0 if all(r["ok"] for r in rows) else 1


def _write(rows, args, noise: float, n: int) -> None:
    """Rewritten after every layout, so a run cut short still leaves its finished rows."""
    header = harness.device_header()
    lines = [
        *harness.report_header(
            f"Tensor / expert / data parallelism of a GLM-5-shaped model on {n} x {header['device']}",
            {
                "model": "GLM-5 widths, random weights identical across layouts: float32 check with "
                f"3 dense + 1 MoE layers, bf16 throughput with 3 dense + {args.layers - 3} MoE",
                "check": f"float32 prefill logits of a {args.prompt_len}-token prompt vs the single-GPU run "
                f"(rel-L2 <= {TOLERANCE}, HIGHEST precision), 8 greedy tokens",
                "bf16 noise floor": "single GPU, bf16 vs float32 logits of the same model: "
                f"{noise:.3g} (only when --layers 4)",
                "throughput": f"LLM.generate: B copies of the prompt, {args.new_tokens} new tokens each, "
                "after a compile run; tok/s = B x new tokens / wall time (includes the prefill)",
            },
        ),
        harness.markdown_table(rows, list(rows[0])),
        "",
    ]
    harness.write_result("multi-gpu", "\n".join(lines), suffix=f"x{n}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
