"""Compile time of the Pallas MoE expert and quantized-linear kernels, per layout and tuning variant.

A cold start on a GPU is mostly XLA compiling the step variants, and inside each the Triton
compiles of the Pallas kernels; the routed experts' INT4 kernels in the int32-word layout unroll
eight 32-row pieces per 256-row chunk and made the 4-layer GLM-5-width start-up 1.8x longer
(``startup-h100-glm5-int4-words-4.md``). This compiles one MoE layer (routing, gate|up, down,
combine: ``moe_experts``) at GLM-5 expert shapes (E = 256, top-8, D = 6144, N = 2048), and with
``--linears`` each of GLM-5's linears (``quant_matmul``), with ``--attention`` GLM-5's absorbed sparse
MLA (``sparse_mla``: 64 heads, 576-wide latent rows, ``--keys`` keys per query), from abstract inputs,
one row at a time in this process with no persistent cache, and reports per row the seconds JAX
takes to lower it (Python: tracing and the Pallas-to-Triton lowering) and XLA to compile it (Triton,
LLVM, ptxas), the lowered module's size (the kernels' Triton IR travels in it) and the config.

Rows: every ``--formats`` x ``--tokens`` MoE layer with the tuning table's config (``--experts``
routed experts: the row tile, and with it the stream or compute tiles, follows the mean tokens per
expert, so a start-up with fewer experts reaches the compute tiles at a smaller T), then each
``--variants`` entry on the first format at the first T (one that fails to lower or compile, say
past the shared memory, gets its error as the row's note); with ``--linears`` every linear in the first
quantized format at each T, then the variants at the first T; with ``--attention`` the sparse MLA in
bf16 at each T. A variant is
``name:field=value+field=value``: fields of :class:`pallas_kernels.moe.tuning.MoeConfig` or of its
``Tile`` (set on both kernels), and for the linears the same names where
:class:`pallas_kernels.quant_matmul.tuning.QmmConfig` has them, or ``int4_decode``
(:func:`pallas_kernels.quant.decode.int4_decode`). ``--parallel`` then compiles the first
format's MoE layer at each T of 1, 2, 4 ... 64 (distinct kernels, as a start-up's token buckets are)
one after another and then side by side on one thread each: how far XLA compiles scale over
threads, which is what the engine's warm-up relies on.

    python -m benchmarks.compile_time                  # on a GPU: every format at T = 1 and 64
    python -m benchmarks.compile_time --formats int4 --tokens 1 --variants s2:num_stages=2 --parallel

Writes ``benchmarks/results/compile_time-<gpu><suffix>.md`` and its JSON. On the CPU the kernels
run in the Pallas interpreter (``--small``: tiny shapes, what the test runs).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.quant import (
    FP4_WORDS,
    GLM5,
    INT4_BYTES,
    SMALL,
    Shapes,
    moe_variant,
    parse_variant,
    random_weight,
)
from pallas_kernels.moe import kernel as moe_kernel
from pallas_kernels.moe import tuning as moe_tuning
from pallas_kernels.quant_matmul import kernel as qmm_kernel
from pallas_kernels.quant_matmul import tuning as qmm_tuning
from pallas_kernels.sparse_mla import kernel as sparse_mla_kernel
from pallas_kernels.sparse_mla import tuning as mla_tuning

FORMATS = ("int4", INT4_BYTES, "fp8", "bf16", "fp4", FP4_WORDS)  # FP4: routed experts only (no --linears)
MOE = "routed experts"
ATTENTION = "sparse MLA"
MLA = (64, 576, 512)  # GLM-5's absorbed attention: heads, row width (latent 512 + rope 64), values
MLA_SMALL = (4, 24, 16)

DEFAULT_VARIANTS = (
    "int4-bf16:int4_decode=bf16",
    "stages-2:num_stages=2",
    "warps-4:num_warps=4",
)
PARALLEL_TOKENS = (1, 2, 4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    changes: dict  # MoeConfig / Tile fields (benchmarks.quant.moe_variant), QmmConfig's for the linears
    int4_decode: str | None = None

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``name:field=value+field=value`` (see the module docstring); ``default`` alone is the table's."""
        name, fields = parse_variant(text)
        int4 = fields.pop("int4_decode", None)
        return cls(name, {k: int(v) for k, v in fields.items()}, int4)

    def apply(self, cfg: moe_tuning.MoeConfig) -> moe_tuning.MoeConfig:
        return moe_variant(**self.changes)(cfg)

    def apply_linear(self, cfg: qmm_tuning.QmmConfig) -> qmm_tuning.QmmConfig:
        """The variant's fields that a linear's config has (``num_stages``, ``block_m`` ...)."""
        own = {f.name for f in dataclasses.fields(qmm_tuning.QmmConfig)}
        return dataclasses.replace(cfg, **{k: v for k, v in self.changes.items() if k in own})


DEFAULT = Variant("default", {})


def _layer_fn(shapes: Shapes, variant: Variant, cfg: moe_tuning.MoeConfig):
    def fn(x, ids, weights, experts):
        return moe_kernel.moe_experts(
            x, ids, weights, experts, config=cfg, int4_decode=variant.int4_decode, interpret=shapes.interpret
        )

    return fn


def _linear_fn(shapes: Shapes, variant: Variant, cfg: qmm_tuning.QmmConfig):
    def fn(x, w):
        return qmm_kernel.quant_matmul(
            x, w, config=cfg, int4_decode=variant.int4_decode, interpret=shapes.interpret
        )

    return fn


def _mla_dims(shapes: Shapes) -> tuple[int, int, int]:
    """(heads, row width, value columns) of the sparse MLA rows: GLM-5's, or tiny ones in the interpreter."""
    return MLA_SMALL if shapes.interpret else MLA


def _attention_fn(shapes: Shapes, cfg: mla_tuning.MlaConfig):
    _, row, values = _mla_dims(shapes)

    def fn(q, kv, indices):
        return sparse_mla_kernel.sparse_mla(
            q, kv, indices, sm_scale=row**-0.5, v_dim=values, interpret=shapes.interpret, config=cfg
        )

    return fn


def _config(shapes: Shapes, variant: Variant, linear: str | None, inputs: tuple):
    """The tuning table's config for these (abstract) inputs, with the variant applied."""
    if linear is None:
        x, ids, _, experts = inputs
        return variant.apply(moe_kernel.default_config(x, ids, experts))
    if linear == ATTENTION:
        q, kv, indices = inputs
        _, row, values = _mla_dims(shapes)
        t, heads, _ = q.shape
        return mla_tuning.choose(t, heads, indices.shape[1], d_v=values, d_r=row - values, itemsize=2)
    x, w = inputs
    return variant.apply_linear(qmm_kernel.default_config(x.shape[0], w, x.dtype))


def _abstract_inputs(shapes: Shapes, fmt: str, t: int, linear: str | None = None, keys: int = 0) -> tuple:
    """ShapeDtypeStructs of one MoE layer's inputs (bf16 tokens, routing, experts in ``fmt``), of
    the named linear's (bf16 tokens, the weight in ``fmt``: INT4 in bytes, as the loader stores
    linears), or of the sparse MLA's (``linear == ATTENTION``: bf16 queries and cache rows, ``keys``
    indices per query)."""
    e, d, n = shapes.experts, shapes.hidden, shapes.expert_width
    key = jax.random.key(0)
    if linear == ATTENTION:
        heads, row, _ = _mla_dims(shapes)
        return (
            jax.ShapeDtypeStruct((t, heads, row), jnp.bfloat16),
            jax.ShapeDtypeStruct((max(keys, 16) * 4, row), jnp.bfloat16),
            jax.ShapeDtypeStruct((t, keys), jnp.int32),
        )
    if linear is not None:
        k, n = shapes.linears[linear]
        return jax.ShapeDtypeStruct((t, k), jnp.bfloat16), jax.eval_shape(random_weight, key, fmt, (), k, n)
    experts = {
        "gate_up": jax.eval_shape(random_weight, key, fmt, (e,), d, 2 * n),
        "down": jax.eval_shape(random_weight, key, fmt, (e,), n, d),
    }
    return (
        jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((t, shapes.top_k), jnp.int32),
        jax.ShapeDtypeStruct((t, shapes.top_k), jnp.float32),
        experts,
    )


def lower(
    shapes: Shapes, fmt: str, t: int, variant: Variant = DEFAULT, linear: str | None = None, keys: int = 0
):
    """``(lowered, seconds, config)``: the MoE layer (or the named linear, or the sparse MLA) traced
    and lowered (the Pallas kernels to Triton IR) with the tuning table's config, variant applied."""
    start = time.perf_counter()
    inputs = _abstract_inputs(shapes, fmt, t, linear, keys)
    cfg = _config(shapes, variant, linear, inputs)
    if linear is None:
        fn = _layer_fn(shapes, variant, cfg)
    else:
        fn = _attention_fn(shapes, cfg) if linear == ATTENTION else _linear_fn(shapes, variant, cfg)
    lowered = jax.jit(fn).lower(*inputs)
    return lowered, time.perf_counter() - start, cfg


def _timed_compile(lowered) -> float:
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start


def measure(
    shapes: Shapes, fmt: str, t: int, variant: Variant = DEFAULT, linear: str | None = None, keys: int = 0
) -> dict:
    lowered, lower_s, cfg = lower(shapes, fmt, t, variant, linear, keys)
    return {
        "op": linear or MOE,
        "format": fmt,
        "T": t,
        "variant": variant.name,
        "lower_s": lower_s,
        "compile_s": _timed_compile(lowered),
        "hlo_kb": len(lowered.as_text()) / 1e3,
        "config": _brief(cfg),
    }


def _brief(cfg) -> str:
    """A config as ``field=value`` pairs, tiles as ``n x k, w warps, s stages``."""
    parts = []
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if isinstance(value, moe_tuning.Tile):
            value = f"{value.block_n}x{value.block_k} w{value.num_warps} s{value.num_stages}"
        parts.append(f"{field.name}={value}")
    return " ".join(parts)


def parallel(shapes: Shapes, fmt: str, tokens: tuple[int, ...]) -> list[dict]:
    """The layer at each T compiled one after another, then all side by side (fresh lowerings, so
    nothing is reused): rows per T, and one row of the two wall times."""
    rows = [measure(shapes, fmt, t) | {"variant": "serial"} for t in tokens]
    lowered = [lower(shapes, fmt, t)[0] for t in tokens]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        each = list(pool.map(_timed_compile, lowered))
    wall = time.perf_counter() - start
    rows += [
        {"op": MOE, "format": fmt, "T": t, "variant": f"side by side ({len(tokens)} threads)", "compile_s": s}
        for t, s in zip(tokens, each)
    ]
    serial = sum(r["compile_s"] for r in rows[: len(tokens)])
    rows.append(
        {
            "op": MOE,
            "format": fmt,
            "T": "all",
            "variant": "wall: serial / side by side",
            "compile_s": wall,
            "note": f"serial {serial:.1f} s, side by side {wall:.1f} s: {serial / wall:.2f}x",
        }
    )
    return rows


def run(args: argparse.Namespace, done=lambda rows: None) -> list[dict]:
    """Every row of ``args``; ``done(rows)`` after each (the report so far survives a time limit)."""
    shapes = _shapes(args)
    tokens = tuple(args.tokens or ((4,) if args.small else (1, 64)))
    variants = [Variant.parse(text) for text in args.variants]
    cases = [(fmt, t, DEFAULT, None) for fmt in args.formats for t in tokens]
    cases += [(args.formats[0], tokens[0], variant, None) for variant in variants]
    if args.linears:  # the first quantized format, each linear at each T, then the variants at the first T
        fmt = next(f for f in args.formats if f != "bf16")
        cases += [(fmt, t, DEFAULT, name) for t in tokens for name in shapes.linears]
        cases += [(fmt, tokens[0], variant, name) for variant in variants for name in shapes.linears]
    if args.attention:
        cases += [("bf16", t, DEFAULT, ATTENTION) for t in tokens]
    rows = []
    for fmt, t, variant, linear in cases:
        try:
            rows.append(measure(shapes, fmt, t, variant, linear, args.keys))
        except Exception as exc:  # noqa: BLE001 - a variant that does not fit must not end the run
            traceback.print_exc()
            row = {"op": linear or MOE, "format": fmt, "T": t, "variant": variant.name}
            rows.append(row | {"note": harness.error_note(exc)})
        print(rows[-1], flush=True)
        done(rows)
    if args.parallel:
        rows += parallel(
            shapes, args.formats[0], tuple(t for t in PARALLEL_TOKENS if not args.small or t <= 4)
        )
        print(rows[-1], flush=True)
        done(rows)
    return rows


def _shapes(args: argparse.Namespace) -> Shapes:
    shapes = SMALL if args.small else GLM5
    return shapes if args.experts is None else dataclasses.replace(shapes, experts=args.experts)


def _mla_line(shapes: Shapes, keys: int) -> str:
    heads, row, values = _mla_dims(shapes)
    return f"{heads} heads, {row}-wide bf16 rows ({values} value columns), {keys} keys per query"


def write_report(rows: list[dict], args: argparse.Namespace, wall_s: float):
    shapes = _shapes(args)
    lines = harness.report_header(
        "Compile time of the MoE layer's and the linears' Pallas kernels (benchmarks/compile_time.py)",
        {
            "shapes": f"E={shapes.experts} top-{shapes.top_k} D={shapes.hidden} N={shapes.expert_width}, "
            "bf16 activations",
            **({"sparse MLA": _mla_line(shapes, args.keys)} if args.attention else {}),
            "benchmark wall time": f"{wall_s:.0f} s",
        },
    )
    lines += [
        "lower_s: JAX tracing and the Pallas-to-Triton lowering (Python); compile_s: XLA's compile "
        "of the jitted layer (the Triton kernels to PTX and cubin). No persistent cache.",
        "",
        harness.markdown_table(
            rows, ["op", "format", "T", "variant", "lower_s", "compile_s", "hlo_kb", "config", "note"]
        ),
        "",
    ]
    return harness.write_result("compile_time", "\n".join(lines), suffix=args.suffix, rows=rows)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--tokens", type=int, nargs="+", help="T per row (default 1 and 64)")
    parser.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS), help="name:field=value+...")
    parser.add_argument("--linears", action="store_true", help="also GLM-5's linears (quant_matmul)")
    parser.add_argument("--attention", action="store_true", help="also the sparse MLA (sparse_mla)")
    parser.add_argument("--keys", type=int, default=256, help="the sparse MLA's keys per query")
    parser.add_argument("--experts", type=int, help="routed experts (default: GLM-5's 256)")
    parser.add_argument("--parallel", action="store_true", help="also compile T = 1 ... 64 side by side")
    parser.add_argument("--small", action="store_true", help="tiny shapes in the Pallas interpreter")
    parser.add_argument("--suffix", default="", help="results file name suffix")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = run(args, lambda rows: write_report(rows, args, time.perf_counter() - start))
    path = write_report(rows, args, time.perf_counter() - start)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
