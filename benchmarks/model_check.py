"""Run the HF golden fixtures through the model on this machine's accelerator and kernels.

The CPU suite checks the Pallas kernels in interpret mode; this runs the same parity checks with
the real lowered kernels (``JAXDSA_KERNELS=pallas`` on a GPU), float32 weights and HIGHEST matmul
precision: rel-L2 per position against HF's logits, and the 16 greedy tokens. The quantized
fixtures keep their weights quantized (INT4 / FP8 linears, ``kv_b``, V4's FP4 experts: the
dequantizing kernels run). ``--kv-cache-dtype fp8`` runs the fixtures that have FP8-cache goldens
(``golden_kv_fp8.npz``: HF with the cache quantized as the released engines define it) with jaxdsa's
fp8 cache, the sparse-MLA and indexer kernels decoding it in place (``JAXDSA_FP_DECODE=software``
forces the sm_80 decoders on any GPU). Writes ``benchmarks/results/model-check-<gpu>.md``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

import jaxdsa
from benchmarks import harness
from jaxdsa import ops
from pallas_kernels.quant.decode import fp_decode

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
NAMES = [
    *("glm5", "dsv32", "glm52", "dsv32_yarn", "glm5_fp8", "dsv32_fp8", "glm5_int4", "dsv32_int4"),
    "glm5_nvfp4",
    *("dsv4", "dsv4_sharded", "dsv4_fp8", "glm53", "glm53_sharded"),
]


def rel_l2(got, want) -> float:
    return float((np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)).max())


def stable_rows(golden, prompt: str, tolerance: float = 1e-4) -> np.ndarray:
    """Rows of ``logits_<prompt>`` to compare: all, except those a golden marks as moving by
    ``tolerance`` or more under last-bit noise in its reference (``ulp_sensitivity_logits_<prompt>``,
    the V4 FP8-cache goldens: an e4m3 rounding within a float32 ulp of its tie)."""
    n = len(golden[f"logits_{prompt}"])
    key = f"ulp_sensitivity_logits_{prompt}"
    return golden[key] < tolerance if key in golden else np.ones(n, bool)


def _score(llm: jaxdsa.LLM, golden, prompt: str) -> float:
    rows = stable_rows(golden, prompt)
    got = llm.score(golden[f"prompt_{prompt}"].tolist())
    return rel_l2(got[rows], golden[f"logits_{prompt}"][rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="golden fixtures through the active kernels")
    p.add_argument("--only", nargs="+", choices=NAMES, default=NAMES, help="these fixtures")
    p.add_argument("--suffix", default="", help="results file name suffix, e.g. -v4")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    args = p.parse_args(argv)
    print(f"kernels: {ops.get_kernels()}")
    goldens = "golden.npz" if args.kv_cache_dtype == "auto" else "golden_kv_fp8.npz"
    failures, rows = 0, []
    for name in [n for n in args.only if (FIXTURES / n / goldens).exists()]:
        start = time.perf_counter()
        golden = np.load(FIXTURES / name / goldens)
        llm = jaxdsa.LLM(
            FIXTURES / name,
            dtype="float32",
            page_size=8,
            progress=False,
            max_model_len=64 * -(-(len(golden["greedy_prompt"]) + 16) // 64),
            kv_cache_dtype=args.kv_cache_dtype,
        )
        short, long = _score(llm, golden, "short"), _score(llm, golden, "long")
        tokens, logits = llm.generate(
            [golden["greedy_prompt"].tolist()], max_new_tokens=16, return_logits=True
        )
        same = tokens[0] == golden["greedy_tokens"].tolist()
        decode = rel_l2(logits[0], golden["greedy_logits"])
        ok = max(short, long, decode) <= 1e-4 and same
        failures += not ok
        rows.append(
            {"fixture": name, "prefill short": short, "prefill long": long, "decode": decode}
            | {"greedy equal": same, "ok": ok, "seconds": time.perf_counter() - start}
        )
        print(
            f"{name:11s} prefill-short {short:.2e}  prefill-long {long:.2e}  decode {decode:.2e}  "
            f"greedy-equal {same}  {'OK' if ok else 'FAIL'}  ({time.perf_counter() - start:.1f}s)"
        )
    lines = harness.report_header(
        "Golden fixtures through the real kernels",
        {
            "kernels": ops.get_kernels(),
            "weights": "float32, HIGHEST matmul precision",
            "kv cache": f"{args.kv_cache_dtype} ({goldens}; fp decode {fp_decode()})",
        },
    )
    lines += [
        "Relative L2 per position against HF transformers 5.23 (max over positions; positions a golden "
        "marks as moving under last-bit noise left out); the 16 greedy tokens through the paged cache.",
        "",
        harness.markdown_table(rows, list(rows[0])),
        "",
    ]
    print(harness.write_result("model-check", "\n".join(lines), suffix=args.suffix, rows=rows))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
