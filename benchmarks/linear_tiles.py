"""Decode-sized quantized linears, tile config by tile config: each kernel's own time, from a trace.

The decode step launches each projection as one ``quant_matmul`` kernel (several projections of the
same input as one launch, :func:`jaxdsa.ops.quant_matmul_many`), inside CUDA graphs, so what a tile
config changes there is the kernel's duration on the GPU, not a host's dispatch. This script runs
one GPU's share of a preset's linears under ``--tp`` (:func:`decode_linears`: the launches of a
GLM-5.2 MoE layer, of a dense layer, each at its TP split) at ``--tokens`` rows, once per tile
variant, and reads every kernel's duration from a ``jax.profiler`` trace
(:func:`benchmarks.anatomy.launched_in`: each variant's calls run inside their own annotated range).

Per (launch, T, variant): the ``quant_matmul`` kernel's mean duration, the other kernels of the call
(the XLA fusion that adds K splits' partial sums), their sum, and the weight bytes over that sum as
GB/s and as % of the read ceiling measured in the same process. Each call reads its own copy of the
weights (enough copies that together they are several times the L2 cache), so every read comes
from HBM, as in a step. Peers in the same process: the same product with bf16 weights through XLA's
dot (``xla:bf16``, twice the bytes of FP8 and four times INT4's) and the weight dequantized first
in XLA (``dequantize-first``, the prefill path). Every variant's output is checked first against
the float32 definition (rel L2 <= 1e-2).

Variants (``--variants``, comma-separated ``name:field=value+field=value``; ``base`` is the tuning
table's config): fields of :class:`pallas_kernels.quant_matmul.tuning.QmmConfig` (``block_n``,
``block_k``: weight rows per K step, ``num_warps``, ``num_stages``, ``splits``, ``gemv``) and
``fill``: K splits chosen for about that many programs per SM (the table aims at 2).

    python -m benchmarks.linear_tiles --tp 4 --tokens 1,8 [--only q_b,o_proj] [--suffix -x]

Writes ``benchmarks/results/linear_tiles-<gpu><suffix>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import anatomy, harness, quant
from benchmarks.serve_gpu import PRESETS
from pallas_kernels.quant.decode import fp_decode, int4_decode
from pallas_kernels.quant.layout import QuantizedWeight, dequantize
from pallas_kernels.quant_matmul import kernel, tuning

MARK = "linear_tiles"
PEERS = ("dequantize-first", "xla:bf16")  # XLA's kernels: every kernel of the call is the product
DEFAULT_VARIANTS = (
    "base,w8:num_warps=8,w2:num_warps=2,n32:block_n=32,n128:block_n=128,n32w8:block_n=32+num_warps=8,"
    "n128w8:block_n=128+num_warps=8,s2:num_stages=2,s4:num_stages=4,f1:fill=1,f4:fill=4,f8:fill=8,"
    "f4w8:fill=4+num_warps=8,k2x:block_k=2x,khalf:block_k=0.5x"
)
TOLERANCE = 1e-2
L2_COPIES_BYTES = 256 << 20  # weight copies per launch: several times an H100 / H200's 50 MB L2


def decode_linears(raw: dict, tp: int) -> dict[str, tuple[tuple[int, int], ...]]:
    """One GPU's share under ``tp``-way tensor parallelism of the quantized projections a decode
    step launches per layer of a DSA model (``raw``: its config.json), each launch as the ``(K, N)``
    of the weights it multiplies together (:func:`jaxdsa.layers.linear.project`). MLA's down
    projections (``q_a``, ``kv_a``, the indexer's ``wk``) are replicated; head-split and MLP columns
    divide N, row-parallel projections (``o_proj``, the down projections) divide K."""
    d, heads = raw["hidden_size"], raw["num_attention_heads"] // tp
    q_lora, latent = raw["q_lora_rank"], raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    q_width = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    index_q = raw["index_n_heads"] // tp * raw["index_head_dim"]
    shared = raw["moe_intermediate_size"] * raw.get("n_shared_experts", 1) // tp
    dense = raw["intermediate_size"] // tp
    return {
        "q_a|kv_a|wk": ((d, q_lora), (d, latent), (d, raw["index_head_dim"])),
        "q_a|kv_a": ((d, q_lora), (d, latent)),
        "q_b": ((q_lora, heads * q_width),),
        "q_b|wq_b": ((q_lora, heads * q_width), (q_lora, index_q)),
        "o_proj": ((heads * raw["v_head_dim"], d),),
        "shared gate|up": ((d, shared), (d, shared)),
        "shared down": ((shared, d),),
        "dense gate|up": ((d, dense), (d, dense)),
        "dense down": ((dense, d),),
    }


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    fields: tuple[tuple[str, str], ...]

    def config(self, base: tuning.QmmConfig, m: int, k: int, n_tiles: int) -> tuning.QmmConfig:
        """``base`` with this variant's fields; ``block_k=2x`` / ``0.5x`` scale the base's K step,
        ``fill`` re-chooses the K splits for that many programs per SM."""
        cfg, fill = base, None
        for key, value in self.fields:
            if key == "fill":
                fill = float(value)
            elif key == "block_k" and value.endswith("x"):
                cfg = dataclasses.replace(cfg, block_k=int(cfg.block_k * float(value[:-1])))
            elif key == "gemv":
                cfg = dataclasses.replace(cfg, gemv=value not in ("0", "false"), block_m=m)
            elif key in {f.name for f in dataclasses.fields(tuning.QmmConfig)}:
                cfg = dataclasses.replace(cfg, **{key: int(value)})
            else:
                raise ValueError(f"variant {self.name}: unknown field {key!r}")
        if fill is not None or any(key in ("block_n", "block_k") for key, _ in self.fields):
            programs = cfg.m_tiles(m) * n_tiles(cfg.block_n)
            splits = tuning.splits_for(programs, k // cfg.block_k, fill=fill or 2, max_splits=64)
            cfg = dataclasses.replace(cfg, splits=splits)
        return cfg


def parse_variants(text: str) -> list[Variant]:
    out = []
    for item in filter(None, (v.strip() for v in text.split(","))):
        name, _, rest = item.partition(":")
        fields = tuple(tuple(f.split("=", 1)) for f in rest.split("+") if f)
        if any(len(f) != 2 for f in fields):
            raise ValueError(f"variant {item!r}: fields are field=value joined by +")
        out.append(Variant(name, fields))
    return out


def _stacks(fmt: str, shapes, copies: int, seed: int) -> tuple[QuantizedWeight, ...]:
    """Per weight of a launch, ``copies`` random copies stacked ``[copies, K, N]`` in the layout of a
    scanned model's linears (the loader's: INT4 in bytes), read in place by a traced index."""
    keys = iter(jax.random.split(jax.random.key(seed), copies * len(shapes)))
    stacks = []
    for k, n in shapes:
        mats = [quant.random_weight(next(keys), fmt, (), k, n) for _ in range(copies)]
        stacks.append(jax.tree.map(lambda *a: jnp.stack(a), *mats))
    return tuple(stacks)


def _spec(fmt: str, k: int, n: int) -> QuantizedWeight:
    """A weight's shape and format without its values, for the tuning table."""
    return jax.eval_shape(functools.partial(quant.random_weight, jax.random.key(0), fmt, (), k, n))


def _impls(fmt: str, shapes, m: int, variants: list[Variant], interpret: bool, peers: tuple[str, ...]):
    """``(name, fn(x, stacks, i) -> one [m, sum N] output of copy i, config or None)`` per variant,
    then the peers (the bf16 one takes the copies' weights concatenated and dequantized)."""
    decode, int4 = fp_decode(), int4_decode(interpret=interpret)
    base = kernel.group_config(m, tuple(_spec(fmt, k, n) for k, n in shapes), jnp.bfloat16)
    k = shapes[0][0]

    def n_tiles(block_n: int) -> int:
        return sum(n // tuning.fit_block(block_n, n, 16, "N") for _, n in shapes)

    def joined(outs) -> jax.Array:
        return jnp.concatenate(outs, axis=-1)

    out = []
    for v in variants:
        cfg = v.config(base, m, k, n_tiles)
        fn = functools.partial(
            kernel._quant_matmul, interpret=interpret, decode=decode, config=cfg, int4=int4
        )
        out.append((v.name, lambda x, ws, i, fn=fn: joined(fn(x, ws, i)), cfg))
    first = lambda x, ws, i: joined([kernel.ref.quant_matmul(x, w, layer=i) for w in ws])  # noqa: E731
    bf16 = lambda x, w, i: jnp.dot(x, w[i], preferred_element_type=jnp.float32)  # noqa: E731
    return out + [(p, {"dequantize-first": first, "xla:bf16": bf16}[p], None) for p in peers]


def _all_copies(fn, copies: int):
    """``fn(x, stacks, i)`` for every copy ``i`` in one ``fori_loop`` (one kernel compiled, as a
    scan over layers runs it); returns copy 0's output (checked) and the last one's."""

    def run(x, stacks):
        first = fn(x, stacks, 0)
        last = jax.lax.fori_loop(1, copies, lambda i, _: fn(x, stacks, i).astype(first.dtype), first)
        return first, last

    return run


def _compile(items: list, threads: int) -> list:
    """Each ``(fn, args)`` jitted and compiled (Triton's compiles on ``threads`` threads), or the
    exception that stopped it."""

    def build(item):
        fn, args = item
        try:
            return jax.jit(fn).lower(*args).compile()
        except Exception as exc:  # noqa: BLE001 - reported in the variant's row
            return exc

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        return list(pool.map(build, items))


def checked(entries: list, want: jax.Array, rows: list[dict]) -> tuple[list, list[dict]]:
    """Each ``(row, compiled or the exception that stopped it, args)``: its first output checked
    against ``want`` (rel L2 <= :data:`TOLERANCE`). A variant that failed becomes a row with a note
    in ``rows``; returns the others' thunks and rows (with ``rel_err``), to be timed."""
    runs, meta = [], []
    for row, exe, args in entries:
        try:
            if isinstance(exe, Exception):
                raise exe
            err = harness.rel_l2(exe(*args)[0].astype(jnp.float32), want)
            if not err <= TOLERANCE:
                raise AssertionError(f"FAILED check (rel L2 {err:.2e})")
        except Exception as exc:  # noqa: BLE001 - one variant must not end the sweep
            rows.append(row | {"note": harness.error_note(exc)})
            continue
        runs.append(functools.partial(exe, *args))
        meta.append(row | {"rel_err": err})
    return runs, meta


def _trace_ranges(runs: list, reps: int, directory: str) -> tuple[list, list]:
    """Run each thunk of ``runs`` ``reps`` times inside its own annotated range under the profiler;
    returns the trace's events and the ranges' ``(start, end)`` in trace time, in ``runs`` order."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(directory, create_perfetto_trace=True, profiler_options=options):
        for i, thunk in enumerate(runs):
            jax.block_until_ready(thunk())
            with jax.profiler.TraceAnnotation(f"{MARK}:{i}"):
                for _ in range(reps):
                    out = thunk()
                jax.block_until_ready(out)
    path = sorted(pathlib.Path(directory).rglob("perfetto_trace.json.gz"))[-1]
    events = anatomy.load(str(path))
    marks = {
        e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("name", "").startswith(MARK)
    }
    return events, [marks[f"{MARK}:{i}"] for i in range(len(runs))]


def without_copies(group: list[dict]) -> list[dict]:
    """Traced kernels less copies and memsets: a ``fori_loop``'s trip count going to the host, no
    part of the product timed."""
    return [k for k in group if not any(word in k["name"].lower() for word in ("memcpy", "memset"))]


def kernel_time(group: list[dict], calls: int, main: str) -> dict[str, float]:
    """One variant's traced kernels over its ``calls`` calls: the mean duration of the kernels named
    ``main`` (µs; every kernel's time per call when ``main`` is empty), the other kernels' time per
    call (the K splits' sum, and the loop's counter: the same for every variant), and the sum per
    call. Copies and memsets (the loop's trip count going to the host) are no part of it."""
    group = without_copies(group)
    mains = [k.get("dur", 0) for k in group if main in k["name"]]
    rest = sum(k.get("dur", 0) for k in group if main not in k["name"])
    total = sum(k.get("dur", 0) for k in group) / calls if group else float("nan")
    kernel_us = total if not main else statistics.mean(mains) if mains else float("nan")
    return {"kernel_us": kernel_us, "other_us": rest / calls, "total_us": total, "kernels": len(group)}


def run(
    raw: dict,
    *,
    tp: int,
    tokens: tuple[int, ...],
    fmt: str,
    variants: list[Variant],
    only: tuple[str, ...] = (),
    reps: int = 3,
    interpret: bool = False,
    threads: int = 8,
    max_copies: int = 64,
    peers: tuple[str, ...] = PEERS,
    progress=None,
) -> tuple[list[dict[str, Any]], float]:
    """Every (launch, T, variant) row and the read ceiling (GB/s). ``interpret``: the CPU
    interpreter checks every variant (no trace, no times). ``progress(rows)`` after each (launch,
    T), so that a run stopped by a time limit still leaves what it measured."""
    ceiling = harness.read_ceiling_gbs(1 << 20 if interpret else 1 << 30)
    rows = []
    launches = decode_linears(raw, tp)
    if unknown := set(only) - set(launches):
        raise SystemExit(f"linear_tiles: unknown launches {sorted(unknown)}; known: {', '.join(launches)}")
    for name, shapes in launches.items():
        if only and name not in only:
            continue
        w_bytes = sum(quant.weight_bytes(w) for w in _stacks(fmt, shapes, 1, 0))
        copies = 1 if interpret else max(2, min(max_copies, -(-L2_COPIES_BYTES // w_bytes)))
        stacks = _stacks(fmt, shapes, copies, 1)
        bf16 = jnp.concatenate([dequantize(w, jnp.bfloat16) for w in stacks], axis=-1)
        want_w = bf16[0].astype(jnp.float32)
        for m in tokens:
            x = jax.random.normal(jax.random.key(m), (m, shapes[0][0]), jnp.bfloat16)
            want = jnp.dot(x.astype(jnp.float32), want_w, precision=jax.lax.Precision.HIGHEST)
            impls = _impls(fmt, shapes, m, variants, interpret, peers)
            items = [
                (_all_copies(fn, copies), (x, bf16 if impl == "xla:bf16" else stacks))
                for impl, fn, _ in impls
            ]
            t0 = time.perf_counter()
            compiled = _compile(items, threads)
            print(
                f"linear_tiles: {name} T={m}: {len(items)} compiled in {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
            entries = []
            for (impl, _, cfg), exe, (_, args) in zip(impls, compiled, items):
                mb = 2 * want_w.size / 1e6 if impl == "xla:bf16" else w_bytes / 1e6
                row = {"launch": name, "T": m, "impl": impl, "MB": mb, "config": _cfg_text(cfg)}
                entries.append((row, exe, args))
            runs, meta = checked(entries, want, rows)
            if interpret:
                rows.extend(meta)
                continue
            with tempfile.TemporaryDirectory() as directory:
                events, ranges = _trace_ranges(runs, reps, directory)
            kernels = anatomy.device_kernels(events, "/device:GPU:0")
            groups = anatomy.launched_in(events, kernels, ranges) or [[] for _ in runs]
            for row, group in zip(meta, groups):
                t = kernel_time(group, copies * reps, "" if row["impl"] in PEERS else "quant_matmul")
                gbs = row["MB"] * 1e3 / t["total_us"]
                rows.append(row | t | {"GB/s": gbs, "% ceiling": 100 * gbs / ceiling})
            if progress is not None:
                progress(rows, ceiling)
        del stacks, bf16
    return rows, ceiling


def _cfg_text(cfg: tuning.QmmConfig | None) -> str:
    if cfg is None:
        return ""
    kind = "gemv" if cfg.gemv else f"m{cfg.block_m}"
    return f"{kind} n{cfg.block_n} k{cfg.block_k} s{cfg.splits} w{cfg.num_warps} st{cfg.num_stages}"


def report(rows: list[dict], ceiling: float, args: argparse.Namespace, wall_s: float) -> str:
    header = harness.device_header() | {
        "preset": f"{args.preset} at -tp {args.tp}, {args.format} weights",
        "read ceiling (jax sum(x))": f"{ceiling:.0f} GB/s",
        "benchmark wall time": f"{wall_s:.0f} s",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "(none)"),
    }
    lines = harness.report_header(
        "Decode-sized quantized linears by tile config (kernel time, traced)", header
    )
    best = collections.defaultdict(list)
    for r in rows:
        if "total_us" in r and r["impl"] not in PEERS:
            best[(r["launch"], r["T"])].append(r)
    lines += ["", "## Best variant per launch", ""]
    summary = []
    for (launch, t), rs in best.items():
        base = next((r for r in rs if r["impl"] == "base"), None)
        top = min(rs, key=lambda r: r["total_us"])
        peer = next((r for r in rows if (r["launch"], r["T"], r["impl"]) == (launch, t, "xla:bf16")), {})
        summary.append(
            {
                "launch": launch,
                "T": t,
                "MB": f"{top['MB']:.2f}",
                "base us": f"{base['total_us']:.1f}" if base else "",
                "best": top["impl"],
                "best us": f"{top['total_us']:.1f}",
                "best % ceiling": f"{top['% ceiling']:.0f}",
                "xla bf16 us": f"{peer['total_us']:.1f}" if "total_us" in peer else "",
                "config": top["config"],
            }
        )
    lines.append(harness.markdown_table(summary, list(summary[0]) if summary else ["launch"]))
    cols = "launch T impl config MB kernel_us other_us total_us GB/s rel_err note".split()
    cols.insert(-2, "% ceiling")
    lines += [
        "",
        "## Every measurement",
        "",
        "kernel_us: the quant_matmul kernel's mean duration; other_us:",
        "the call's other kernels (the K splits' sum); total_us: both, per call.",
        "",
        table(rows, cols),
    ]
    return "\n".join(lines) + "\n"


def table(rows: list[dict], cols: list[str]) -> str:
    """``rows`` as a markdown table of ``cols``, floats to three significant digits."""
    text = [{c: (f"{r[c]:.3g}" if isinstance(r.get(c), float) else r.get(c, "")) for c in cols} for r in rows]
    return harness.markdown_table(text, cols)


def sweep_args(description: str, tokens: str) -> argparse.ArgumentParser:
    """The arguments both tile sweeps take (this one and :mod:`benchmarks.moe_tiles`)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", choices=sorted(PRESETS), default="glm52")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--tokens", default=tokens)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=8, help="compiles at once")
    p.add_argument("--suffix", default="")
    return p


def main(argv: list[str] | None = None) -> pathlib.Path:
    p = sweep_args(__doc__.splitlines()[0], "1,8,32")
    p.add_argument("--format", default="int4", choices=("int4", "fp8"))
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--only", default="", help="comma-separated launch names (decode_linears)")
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        help="XLA peers timed beside the kernel (comma-separated, 'none'); XLA autotunes their dots",
    )
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    paths = []

    def write(rows: list[dict], ceiling: float) -> None:
        text = report(rows, ceiling, args, time.perf_counter() - t0)
        paths[:] = [harness.write_result("linear_tiles", text, args.suffix, rows=rows)]

    rows, ceiling = run(
        PRESETS[args.preset],
        tp=args.tp,
        tokens=tuple(int(t) for t in args.tokens.split(",")),
        fmt=args.format,
        variants=parse_variants(args.variants),
        only=tuple(filter(None, args.only.split(","))),
        reps=args.reps,
        threads=args.threads,
        peers=tuple(p for p in args.peers.split(",") if p and p != "none"),
        progress=write,
    )
    write(rows, ceiling)
    print(paths[0].read_text())
    return paths[0]


if __name__ == "__main__":
    main()
