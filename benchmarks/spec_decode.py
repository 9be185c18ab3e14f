"""MTP speculative decoding at GLM-5.x widths: what a verify step costs, and the tokens/s it buys as a
function of the acceptance rate.

The model has a preset's layer widths (``--preset``, see :mod:`benchmarks.serve_gpu`) with 3 dense
layers, ``--layers - 3`` MoE layers and the MTP layer (a MoE decoder layer behind ``eh_proj``), random
weights made on the device, bf16 or kept in ``--quantization``'s format, on one GPU or a mesh (``-tp``
/ ``-ep`` / ``-dp``: at the released depth, 78 layers of GLM-5.2 INT4 at ``-tp 4``). For each batch
``B`` (sequences decoding together at a ``--context``-token prompt) the script times ``Engine.step``
at steady decode: once on an engine without speculation (``t0``: one token per sequence) and once per
draft count ``N`` on an engine with ``{"method": "mtp", "num_speculative_tokens": N}`` over the same
weights (``tN``: the main model over ``N + 1`` positions per sequence, the verifier, and ``N`` MTP
passes). Both times include the host's part of a step (scheduling, packing, the fetch of the sampled
ids), as a server's steps do.

Random weights accept almost no drafts, so the rate is an input, not a measurement: with each draft
accepted with probability ``a`` independently of the others (the usual model, e.g. Leviathan et al.
2023), a step emits ``E = (1 - a ** (N + 1)) / (1 - a)`` tokens per sequence on average, and
speculation serves ``B * E / tN`` tokens/s against ``B / t0``. The table gives that curve; the
acceptance a real checkpoint reaches is the engine's ``spec_decode_*`` metrics on real traffic.

    python -m benchmarks.spec_decode [--layers 4] [--context 512] [--batches 1,8,32] [--drafts 1,2,3,5]
    python -m benchmarks.spec_decode --preset glm52 --layers 78 --quantization int4 -tp 4 --batches 1,8
    python -m benchmarks.spec_decode --tiny    # the tiny GLM-5 checkpoint: a CPU smoke run

Writes benchmarks/results/spec_decode-<gpu>.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax

import jaxdsa
from benchmarks import harness, serve_gpu
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.engine import Engine, SamplingParams, SpeculativeConfig

RATES = (0.5, 0.7, 0.8, 0.9)


def tokens_per_step(num_spec: int, rate: float) -> float:
    """Expected tokens a verify step emits per sequence when each draft is kept with probability
    ``rate`` (drafts after a rejected one are discarded): 1 + a + ... + a^N."""
    return sum(rate**j for j in range(num_spec + 1))


def engine_for(llm: jaxdsa.LLM, num_spec: int) -> Engine:
    """An engine over ``llm``'s weights, with ``num_spec`` drafts per step (0: none)."""
    return llm.new_engine(speculative=SpeculativeConfig("mtp", num_spec) if num_spec else None)


def start_batch(engine: Engine, batch: int, context: int) -> list[str]:
    """``batch`` requests with ``context``-token prompts, run until all of them decode (a few decode
    steps included, so every step shape timed later is compiled); returns their ids."""
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    vocab, room = engine.cfg.vocab_size, engine.max_model_len - context
    for i, rid in enumerate(ids):
        prompt = [(7 * i + 13 * p) % (vocab - 2) + 2 for p in range(context)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=room, ignore_eos=True))
    while any(r.num_computed < len(r.prompt) for r in engine.requests.values()):
        _checked(engine.step())
    for _ in range(3):
        _checked(engine.step())
    return ids


def step_seconds(engine: Engine, steps: int) -> list[float]:
    """Seconds of each of ``steps`` consecutive ``Engine.step`` calls."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        _checked(outputs)
    return times


def step_ms(
    engines: dict[int, Engine], batch: int, context: int, steps: int, rounds: int
) -> dict[int, float]:
    """Per engine, the median milliseconds of a decode step of ``batch`` sequences: ``rounds`` rounds
    of ``steps`` steps, the engines taking turns in each round (so a slow spell of the host or the
    device falls on all of them alike)."""
    ids = {n: start_batch(engine, batch, context) for n, engine in engines.items()}
    times: dict[int, list[float]] = {n: [] for n in engines}
    for _ in range(rounds):
        for n, engine in engines.items():
            times[n] += step_seconds(engine, steps)
    for n, engine in engines.items():
        for rid in ids[n]:
            engine.abort(rid)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def _checked(outputs) -> None:
    """A failed request (the engine isolates it and goes on) would leave a faster, emptier batch."""
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")


def load(args: argparse.Namespace, directory: str) -> jaxdsa.LLM:
    longest = args.context + (args.rounds * args.steps + 8) * (max(args.drafts) + 1)
    engine = dict(max_num_seqs=max(args.batches), max_model_len=longest, max_num_batched_tokens=args.context)
    if args.tiny:
        path = make_tiny("glm_moe_dsa", directory, seed=7, preset="glm5")
        return jaxdsa.LLM(path, dtype="float32", page_size=8, progress=False, **engine)
    overrides = {**json.loads(args.overrides), "num_nextn_predict_layers": 1}
    serve_gpu.write_model_dir(directory, args.layers, overrides, args.preset)
    return serve_gpu.dummy_llm(directory, args, **engine)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="main-model layers (3 dense, the rest MoE)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--drafts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 5])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the variants taking turns in each")
    parser.add_argument("--tiny", action="store_true", help="the tiny GLM-5 checkpoint (CPU smoke run)")
    parser.add_argument("--preset", choices=["glm5", "glm52"], default="glm5")
    parser.add_argument("--quantization", choices=sorted(serve_gpu.WEIGHTS), default="dequantize")
    parser.add_argument("--overrides", default="{}", help="JSON config overrides (CPU runs use small widths)")
    parser.add_argument("--suffix", default="", help="results file name suffix (default: -<layers>layers)")
    serve_gpu.add_parallel_arguments(parser)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        llm = load(args, directory)
        engines = {n: engine_for(llm, n) for n in [0, *args.drafts]}
        per_batch = {b: step_ms(engines, b, args.context, args.steps, args.rounds) for b in args.batches}
        times = {n: {b: per_batch[b][n] for b in args.batches} for n in engines}
        for n in engines:
            print(f"N={n}: " + ", ".join(f"B={b} {t:.2f} ms" for b, t in times[n].items()))
    rows = []
    for b in args.batches:
        t0 = times[0][b]
        for num_spec in args.drafts:
            t = times[num_spec][b]
            row = {"batch": b, "drafts": num_spec, "plain step ms": t0, "verify step ms": t}
            row |= {"added ms": t - t0, "cost": t / t0}
            for rate in RATES:
                row[f"speedup a={rate}"] = tokens_per_step(num_spec, rate) * t0 / t
            rows.append(row)
    par = serve_gpu.parallelism(args)
    kept = {"dequantize": "bf16"}.get(args.quantization, args.quantization.upper())
    model = (
        "tiny GLM-5 preset (float32)"
        if args.tiny
        else f"{args.preset} widths, {args.layers} layers + MTP, {kept}; {serve_gpu.describe(par)}"
    )
    lines = harness.report_header(
        "MTP speculative decoding: verify-step cost and tokens/s vs acceptance",
        {
            "model": model,
            "context": f"{args.context} tokens",
            "timed": f"median of {args.rounds} rounds x {args.steps} Engine.step calls per variant, "
            "the variants taking turns in each round",
            "benchmark wall time": f"{time.perf_counter() - start:.0f} s",
        },
    )
    columns = ["batch", "drafts", "plain step ms", "verify step ms", "added ms", "cost"]
    columns += [f"speedup a={r}" for r in RATES]
    lines += [
        "`added ms` = verify step - plain step; `cost` = verify step / plain step; `speedup a=x` = tokens/s",
        "with speculation over tokens/s without, if each draft is accepted with probability x (tokens per",
        "step 1 + x + ... + x^N).",
        "",
        harness.markdown_table(rows, columns),
        "",
    ]
    if not args.tiny and args.layers < 78:
        lines += [
            "Depth: the MTP layer is one decoder layer plus the LM head at any depth, while the plain step",
            f"grows with the main model's layers. Here it weighs as much as one of {args.layers} main layers",
            "(GLM-5 has 78), so `cost` is far above, and `speedup` far below, what the whole model sees;",
            "compare runs at two depths for the part that grows with it.",
            "",
        ]
    suffix = args.suffix or ("-tiny" if args.tiny else f"-{args.layers}layers")
    path = harness.write_result("spec_decode", "\n".join(lines), suffix=suffix, rows=rows)
    print(f"wrote {path} ({jax.devices()[0].device_kind})")
    return path


if __name__ == "__main__":
    main()
