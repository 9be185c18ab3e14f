"""GPU benchmark: dense causal prefill attention (the expanded-KV MLA path) against torch's cuDNN SDPA.

Single-sequence prefill runs :func:`jaxdsa.layers.mla.naive_attention`: per-head keys and values
expanded from the latent rows, then ``jax.nn.dot_product_attention`` with a boolean [T, S] mask and
XLA's default implementation. This times that call (``ours``) at GLM-5's widths (H = 64, q/k and v
head dims 256, batch 1, bf16) and, on the same buffers, ``jax.nn.dot_product_attention`` through
cuDNN (``is_causal``, the form a causal-only mask allows) and torch's SDPA through cuDNN
(:func:`benchmarks.peers.sdpa_cudnn`). Each is checked against a float32 reference on every 8th
head (rel L2 <= 1e-2). flops = 2 * T^2 * H * (dqk + dv) / 2 (the causal half).

    python -m benchmarks.attention

Writes ``benchmarks/results/attention-<gpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import harness

H, DQK, DV = 64, 256, 256
SCALE = DQK**-0.5
TOKENS = (1024, 4096)
SETS = 2
TOLERANCE = 1e-2
CHECK_HEADS = slice(0, H, 8)


def _inputs(key, t: int):
    kq, kk, kv = jax.random.split(key, 3)
    shape = (1, t, H, DQK)
    return (
        jax.random.normal(kq, shape, jnp.bfloat16),
        jax.random.normal(kk, shape, jnp.bfloat16),
        jax.random.normal(kv, (1, t, H, DV), jnp.bfloat16),
    )


def ours(q, k, v):
    """What naive_attention runs: the default implementation with an explicit causal mask."""
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], scale=SCALE)


def jax_cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=SCALE, implementation="cudnn")


@jax.jit
def _reference(q, k, v):
    """Float32 causal attention on every 8th head."""
    q, k, v = (a[:, :, CHECK_HEADS].astype(jnp.float32) for a in (q, k, v))
    s = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * SCALE
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v, precision="highest")


def _check(out, want) -> float:
    return harness.rel_l2(out[:, :, CHECK_HEADS], want)


def _jax_row(name: str, fn: Callable, sets: list, want) -> dict[str, Any]:
    try:
        err = _check(jax.jit(fn)(*sets[0]), want)
        if err > TOLERANCE:
            return {"impl": name, "rel_err": err, "note": f"FAILED check (rel L2 {err:.2e})"}
        return {"impl": name, "rel_err": err, "us": harness.time_op(fn, sets, replays=10) * 1e6}
    except Exception as exc:  # noqa: BLE001 - one failing implementation must not end the run
        traceback.print_exc()
        return {"impl": name, "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}


def _torch_row(sets: list, want) -> dict[str, Any]:
    from benchmarks import peers

    name = "torch SDPA cuDNN"
    try:
        tsets = [tuple(peers.to_torch(a) for a in s) for s in sets]
        err = _check(peers.to_jax(peers.sdpa_cudnn(*tsets[0], SCALE)), want)
        if err > TOLERANCE:
            return {"impl": name, "rel_err": err, "note": f"FAILED check (rel L2 {err:.2e})"}
        sec, how = peers.time_torch(lambda q, k, v: peers.sdpa_cudnn(q, k, v, SCALE), tsets, replays=10)
    except Exception as exc:  # noqa: BLE001 - a failing peer must not end the run
        traceback.print_exc()
        return {"impl": name, "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    return {"impl": name, "rel_err": err, "us": sec * 1e6, "note": how}


def run(ceilings: harness.Ceilings | None = None, *, torch_peers: bool = False) -> list[dict]:
    start = time.perf_counter()
    ceilings = ceilings or harness.measure_ceilings(torch_peers)
    rows = []
    for t in TOKENS:
        sets = [_inputs(k, t) for k in jax.random.split(jax.random.key(t), SETS)]
        want = _reference(*sets[0])
        gflop = 2 * t * t * H * (DQK + DV) / 2 / 1e9
        found = [_jax_row("ours (jax.nn, XLA, bool mask)", ours, sets, want)]
        found.append(_jax_row("jax.nn cuDNN (is_causal)", jax_cudnn, sets, want))
        if torch_peers:
            found.append(_torch_row(sets, want))
        for row in found:
            row = {"T": t, "H": H, "dqk/dv": f"{DQK}/{DV}", "GFLOP": gflop} | row
            if "us" in row:
                tflops = gflop / row["us"] / 1e3
                row |= {"TFLOP/s": tflops, "% mm": 100 * tflops / ceilings.matmul_tflops}
            print(row, flush=True)
            rows.append(row)
    _write(rows, ceilings, time.perf_counter() - start)
    return rows


COLUMNS = ("T", "H", "dqk/dv", "GFLOP", "impl", "us", "TFLOP/s", "% mm", "rel_err", "note")


def _write(rows: list[dict], ceilings: harness.Ceilings, elapsed: float) -> None:
    lines = [
        *harness.report_header(
            f"Dense causal prefill attention (GLM-5 widths, bf16) on {harness.device_header()['device']}",
            harness.ceiling_rows(ceilings, elapsed),
        ),
        "Method: see the docstring of `benchmarks/attention.py`.",
        "",
        harness.markdown_table(rows, COLUMNS),
        "",
    ]
    print(f"attention: wrote {harness.write_result('attention', chr(10).join(lines), rows=rows)}")


if __name__ == "__main__":
    run()
