"""Host time per decode step: what the engine spends outside the device on each step.

A tiny model on the CPU makes the device work negligible, so the time of ``Engine.step`` at a
steady decode batch is mostly host work: scheduling, packing the step's buffers, the jitted
call's dispatch (argument flattening, the model's leaves), and reading the sampled ids back.
Only the public ``jaxdsa.LLM`` / ``Engine`` API is used, so the same script times any commit:

    python -m benchmarks.host_overhead --model DIR [--batch 8] [--steps 200] [--repeats 5]

Prints one JSON line: median milliseconds per decode step over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jaxdsa
from jaxdsa.engine import SamplingParams


def decode_ms(llm: jaxdsa.LLM, batch: int, steps: int) -> float:
    """Milliseconds per step over ``steps`` decode steps of ``batch`` running requests."""
    engine = llm.engine
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [1 + i, 2, 3, 4], SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):  # prefill and the first decodes: every request is now decoding
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory (tests/fixtures/glm5)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = jaxdsa.LLM(args.model, dtype="float32", page_size=8, progress=False, max_model_len=256)
    llm.engine.warmup(progress=False)
    decode_ms(llm, args.batch, 16)  # compile anything warm-up left out
    runs = [decode_ms(llm, args.batch, args.steps) for _ in range(args.repeats)]
    print(json.dumps({"ms_per_step": statistics.median(runs), "runs": runs, "batch": args.batch}))


if __name__ == "__main__":
    main()
