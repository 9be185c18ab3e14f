"""GPU benchmark: the engine's sampler at GLM-5's vocabulary (154,880), candidates vs full sort.

Run ``python -m benchmarks.sampler`` on a GPU. Per batch of R rows it times
:func:`jaxdsa.engine.sampling.sample` with the default ``candidates`` (the filters rank each row's
top 1024 logits) against ``candidates = V`` (every row sorted whole, the sampler before
candidates) in the same process, for:

* ``top_p 0.95``: temperature 0.7, top-p 0.95 on language-model-like logits (``-1.5 log rank``
  plus N(0, 0.5) noise, ranks shuffled: Zipf-like mass, which the candidates hold);
* ``top_k 50``: temperature 0.7, top-k 50, same logits;
* ``plain``: temperature 1, no filter, same logits;
* ``fallback``: top-p 0.99 on flat logits N(0, 0.1), whose mass the candidates cannot reach, so
  every call falls back to the full sort (the price of the check);
* ``greedy flat``: temperature 0 with top-p 0.95 on the flat logits: greedy rows skip the filters,
  so no fallback (a random-weight model's logits are this flat);
* ``penalized``: ``top_p 0.95`` with all penalties on and 20 logprobs (the penalized variant's
  extra gathers and its second ranking of the raw logits).

Both ways sample the same tokens (checked on every case: identical ids from the same seeds).
Time: :func:`benchmarks.harness.time_op`, median of 20 replays. Writes
``benchmarks/results/sampler-<gpu>.md`` (``-subset`` when only some rows or cases ran; and ``.json``).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from jaxdsa.engine.sampling import Penalties, sample

V = 154880
ROWS = (1, 8, 32, 128, 256)
CASES = {  # name -> (logits, temperature, top_p, top_k, penalized)
    "top_p 0.95": ("lm", 0.7, 0.95, 0, False),
    "top_k 50": ("lm", 0.7, 1.0, 50, False),
    "plain": ("lm", 1.0, 1.0, 0, False),
    "fallback": ("flat", 1.0, 0.99, 0, False),
    "greedy flat": ("flat", 0.0, 0.95, 0, False),
    "penalized": ("lm", 0.7, 0.95, 0, True),
}


def _logits(rng: np.random.Generator, r: int, kind: str) -> np.ndarray:
    if kind == "flat":
        return rng.normal(0, 0.1, (r, V))
    zipf = -1.5 * np.log(np.arange(1, V + 1)) + rng.normal(0, 0.5, (r, V))
    return np.take_along_axis(zipf, np.argsort(rng.random((r, V)), axis=1), axis=1)


def _inputs(r: int, kind: str, temperature: float, top_p: float, top_k: int, penalized: bool):
    rng = np.random.default_rng(r)
    logits = jnp.asarray(_logits(rng, r, kind), jnp.float32)
    rows = (
        jnp.full(r, temperature),
        jnp.full(r, top_p),
        jnp.full(r, top_k, jnp.int32),
        jnp.arange(r, dtype=jnp.int32),
        jnp.zeros(r, jnp.int32),
    )
    penalties = None
    if penalized:
        counts = jnp.asarray(rng.integers(0, 2, (r, V)) * (rng.random((r, V)) < 0.002), jnp.int32)
        penalties = Penalties(
            counts,
            jnp.asarray(rng.random((r, V)) < 0.01),
            jnp.zeros((r, V), jnp.float32),
            jnp.arange(r, dtype=jnp.int32),
            jnp.full(r, 0.5),
            jnp.full(r, 0.3),
            jnp.full(r, 1.1),
            jnp.ones(r, bool),
        )
    return logits, rows, penalties


def run(batches: tuple[int, ...] = ROWS, cases: tuple[str, ...] = tuple(CASES)) -> list[dict]:
    start = time.perf_counter()
    results = []
    for name in cases:
        kind, temperature, top_p, top_k, penalized = CASES[name]
        for r in batches:
            logits, rows, penalties = _inputs(r, kind, temperature, top_p, top_k, penalized)
            logprobs = 20 if penalized else 0
            row = {"case": name, "R": r}
            ids = {}
            for label, candidates in (("candidates", 1024), ("full sort", V)):
                # rows as arguments: no constant folding of the filters
                def fn(x, rows, p, candidates=candidates, logprobs=logprobs):
                    return sample(x, *rows, None, p, num_logprobs=logprobs, candidates=candidates).ids

                ids[label] = np.asarray(jax.jit(fn)(logits, rows, penalties))
                row[f"{label} us"] = harness.time_op(fn, [(logits, rows, penalties)], replays=20) * 1e6
            row["speed-up"] = row["full sort us"] / row["candidates us"]
            row["same ids"] = bool((ids["candidates"] == ids["full sort"]).all())
            print(row, flush=True)
            results.append(row)
    _write(results, time.perf_counter() - start, subset=batches != ROWS or cases != tuple(CASES))
    return results


def _write(results: list[dict], elapsed: float, subset: bool) -> None:
    lines = [
        *harness.report_header(
            f"Sampler at V = {V} on {harness.device_header()['device']}",
            {"benchmark wall time": f"{elapsed:.0f} s"},
        ),
        "Method: see the docstring of `benchmarks/sampler.py`.",
        "",
        harness.markdown_table(
            results, ("case", "R", "candidates us", "full sort us", "speed-up", "same ids")
        ),
        "",
    ]
    path = harness.write_result("sampler", "\n".join(lines), "-subset" if subset else "", rows=results)
    print(f"sampler: wrote {path}")


if __name__ == "__main__":
    run()
