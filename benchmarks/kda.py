"""GLM-5.3-Flash's KDA kernels at the released widths: decode steps and chunked prefill against their
pure-JAX refs (XLA) and the bytes' ceiling.

Decode (one token for each of B sequences, H heads, K = V = head dim): each step reads and writes every
sequence's float32 state [H, K, V], so its floor is those bytes at the HBM ceiling measured in the same
run. Prefill (one sequence of T tokens, chunks of 64): reported as µs and tokens/s beside the ref, whose
chunks run as an XLA scan, and beside the packed recurrent kernel (token by token, the path the model's
steps take today: ``packed_us``). Every kernel result is checked against the ref (rel-L2) before it is timed.

    python -m benchmarks.kda [--heads 64] [--head-dim 128] [--batches 1,16,64] [--lengths 512,2048,8192]

Writes benchmarks/results/kda-<gpu><suffix>.md and .json.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks import harness
from pallas_kernels.kda import kernel, ref


def inputs(key, t: int, h: int, d: int, batch: int | None, dtype):
    """q, k, v, g, beta (and a float32 state) for ``batch`` sequences of one token, or one of ``t``."""
    lead = (batch,) if batch is not None else (t,)
    ks = jax.random.split(key, 6)
    q, k, v = (jax.random.normal(ks[i], (*lead, h, d), dtype) for i in range(3))
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (*lead, h, d), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (*lead, h), jnp.float32))
    state_shape = (batch, h, d, d) if batch is not None else (h, d, d)
    state = 0.1 * jax.random.normal(ks[5], state_shape, jnp.float32)
    return q, k, v, g, beta, state


def decode_rows(h: int, d: int, batches: list[int], gbs: float) -> list[dict]:
    rows = []
    ref_step = jax.vmap(
        lambda q, k, v, g, b, s: ref.recurrent(q[None], k[None], v[None], g[None], b[None], s)
    )
    for batch in batches:
        args = inputs(jax.random.key(batch), 1, h, d, batch, jnp.bfloat16)
        got, want = kernel.recurrent_step(*args), ref_step(*args)
        err = max(harness.rel_l2(got[0], want[0][:, 0]), harness.rel_l2(got[1], want[1]))
        pallas = harness.time_op(kernel.recurrent_step, [args])
        xla = harness.time_op(ref_step, [args])
        state_bytes = 2 * batch * h * d * d * 4  # read + write
        floor = state_bytes / (gbs * 1e9)
        rows.append(
            {
                "kernel": "decode",
                "B or T": batch,
                "pallas_us": round(pallas * 1e6, 1),
                "packed_us": "",
                "ref_us": round(xla * 1e6, 1),
                "floor_us": round(floor * 1e6, 1),
                "of_ceiling": f"{floor / pallas:.0%}",
                "rel_l2": f"{err:.1e}",
            }
        )
        print(rows[-1], flush=True)
    return rows


def packed_prefill(q, k, v, g, beta, state):
    """One sequence through :func:`kernel.recurrent_packed` (its state in row 0 of a one-row buffer)."""
    one = jnp.zeros((1,), jnp.int32)
    o, s = kernel.recurrent_packed(
        q, k, v, g, beta, state[None], seq_ids=jnp.zeros(q.shape[:1], jnp.int32), rows=one, fresh=one > 0
    )
    return o, s[0]


def prefill_rows(h: int, d: int, lengths: list[int]) -> list[dict]:
    rows = []
    ref_chunked = jax.jit(functools.partial(ref.chunked, chunk=64))
    packed = jax.jit(packed_prefill)
    for t in lengths:
        args = inputs(jax.random.key(t), t, h, d, None, jnp.bfloat16)
        got, want, by_token = kernel.chunked(*args), ref_chunked(*args), packed(*args)
        err = max(harness.rel_l2(a[i], want[i]) for a in (got, by_token) for i in (0, 1))
        pallas = harness.time_op(kernel.chunked, [args], replays=5)
        xla = harness.time_op(ref_chunked, [args], replays=5)
        token_by_token = harness.time_op(packed, [args], replays=5)
        rows.append(
            {
                "kernel": "prefill",
                "B or T": t,
                "pallas_us": round(pallas * 1e6, 1),
                "packed_us": round(token_by_token * 1e6, 1),
                "ref_us": round(xla * 1e6, 1),
                "floor_us": "",
                "of_ceiling": f"{t / pallas / 1e3:.0f}k tok/s",
                "rel_l2": f"{err:.1e}",
            }
        )
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=64, help="KDA heads on one GPU (64 released; 16 at -tp 4)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--lengths", default="512,2048,8192")
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    gbs = harness.copy_ceiling_gbs()
    rows = decode_rows(args.heads, args.head_dim, [int(b) for b in args.batches.split(",")], gbs)
    rows += prefill_rows(args.heads, args.head_dim, [int(t) for t in args.lengths.split(",")])
    title = f"KDA kernels, {args.heads} heads of {args.head_dim}, bf16 inputs, float32 state"
    text = harness.report_header(title, {"HBM copy ceiling": f"{gbs:.0f} GB/s (read + write)"})
    text += [harness.markdown_table(rows, list(rows[0])), ""]
    path = harness.write_result("kda", "\n".join(text), args.suffix, rows)
    print(path)
    return path


if __name__ == "__main__":
    main()
