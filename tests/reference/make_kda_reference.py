#!/usr/bin/env python3
"""Make ``tests/fixtures/kda/reference.npz``: HF's PyTorch KDA and short-conv functions on random float32
inputs, the oracle for ``pallas_kernels/kda/ref.py`` (not part of CI).

Run with the reference venv ``<venv>`` (README.md here sets it up: torch==2.13.0 CPU,
transformers==5.23.0, which ships ``glm5_next``):

    <venv>/bin/python tests/reference/make_kda_reference.py [--out DIR]

Independent of jaxdsa (no JAX, nothing imported from the package). It calls HF's own module-level
functions of ``transformers.models.glm5_next.modeling_glm5_next`` exactly as ``Glm5NextTextLinearAttention``
calls them:

* ``chunk_kimi_delta_attention`` (prefill) and ``recurrent_kimi_delta_attention`` (decode) with
  ``use_qk_l2norm_in_kernel=True`` (q, k unnormalized as they leave the conv), ``output_final_state=True``,
  with and without an initial state, on one sequence per case (B = 1), T in {0, 1, 5, 63, 64, 65, 130},
  H = 2, K in {16, 32}, V in {16, 32}; both functions on every case, and for one case the layer's decode
  chain (three T = 1 recurrent steps from the chunked prefill's state). One case runs with
  ``use_qk_l2norm_in_kernel=False`` on keys of norm ~1 and one with ``chunk_size=16``;
* the log-decay g from HF's own ``Glm5NextTextForgetGate`` (``linear_lower_bound = -5``, random
  projections, ``dt_bias`` / ``A_log`` drawn so that the per-channel decays span (-5, 0): "mixed" cases
  have channels near both ends, "mild" ones (g ~ -0.01 .. -0.1) keep the state alive across chunks);
  beta = sigmoid(N(0, 1.5^2)) in (0, 1);
* the short conv through the layer's own control flow: HF's ``LinearAttentionLayer`` cache with
  ``update_conv_state`` + ``causal_conv1d_fn`` for a prefill (first or continued, the cache concatenated
  before it) and ``causal_conv1d_update`` for one token once the cache exists (the layer's rule).

Checks that fail the run (the self-test): FLA / causal-conv1d are not importable (so HF's functions are
the torch fallbacks this fixture is about); HF's recurrent and chunked outputs and final states are
within 1e-5 (rel L2) of a float64 numpy evaluation of the same recurrence (a case whose float32 results
are not that well determined is no fixture for a 1e-5 test); HF's conv outputs and cache equal a float64
numpy conv (rel L2 <= 1e-6); a second run in the same process gives bit-identical arrays. Deterministic
(fixed seeds, one thread); the npz is written with fixed zip timestamps, so a rerun rewrites the same bytes.

Layout in the npz (per KDA case ``<name>``): ``<name>.q/.k/.g`` [T+D, H, K], ``.v`` [T+D, H, V], ``.beta``
[T+D, H] (D decode tokens after the prefill, usually 0), ``.state0`` [H, K, V] (when the case has one),
``.o_rec/.o_chunk`` [T, H, V], ``.s_rec/.s_chunk`` [H, K, V], and for the decode chain ``.o_decode``
[D, H, V], ``.s_decode``. Per conv scenario ``<name>``: ``.x`` [B, C, T] and ``.y`` [B, C, T] in HF's
channel-major layout, ``.weight`` [C, W] (``conv1d.weight.squeeze(1)``), ``.bias`` [C] (when used),
``.cache`` [segments, B, C, W] (HF's cache after each call: the last W inputs). ``meta`` is a JSON string:
the cases' parameters, segment lengths and the self-test's measured errors; ``hf_version``,
``torch_version``, ``numpy_version``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from make_goldens import save_npz  # same folder: np.savez with fixed zip timestamps
from transformers.cache_utils import LinearAttentionLayer
from transformers.models.glm5_next import modeling_glm5_next as hf
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "kda"

SEED = 20260
H = 2
HIDDEN = 64  # the forget gate's input width (only g leaves the gate)
LOWER_BOUND = -5.0
MAX_F64_REL = 1e-5  # HF float32 vs a float64 evaluation, per output / state
MAX_CONV_REL = 1e-6

# name: T prefill tokens, K, V, initial state, gate regime, chunk size, in-kernel L2 norm, D decode tokens
KDA_CASES: list[dict[str, Any]] = [
    dict(name="t0_state", t=0, k=16, v=16, state=True, gates="mixed"),
    dict(name="t1", t=1, k=16, v=16, state=False, gates="mixed"),
    dict(name="t5_state", t=5, k=16, v=32, state=True, gates="mixed"),
    dict(name="t63", t=63, k=32, v=16, state=False, gates="mixed"),
    dict(name="t64_state", t=64, k=32, v=32, state=True, gates="mild"),
    dict(name="t65_state_decode", t=65, k=16, v=16, state=True, gates="mild", decode=3),
    dict(name="t130_state", t=130, k=32, v=16, state=True, gates="mixed"),
    dict(name="t130_mild", t=130, k=16, v=32, state=False, gates="mild"),
    dict(name="t65_chunk16", t=65, k=16, v=16, state=True, gates="mild", chunk=16),
    dict(name="t65_no_l2norm", t=65, k=32, v=16, state=True, gates="mixed", l2norm=False),
]
# name: B sequences, C channels, W width, bias, activation, lengths of the layer's calls in order
CONV_CASES: list[dict[str, Any]] = [
    dict(name="conv_silu", b=2, c=96, w=4, bias=False, activation="silu", segments=[6, 3, 1, 1, 1]),
    dict(name="conv_bias_none", b=2, c=48, w=4, bias=True, activation=None, segments=[1, 2, 1, 5, 1]),
]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64 (0 for two empty arrays)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / den) if den else float(np.linalg.norm(a - b))


# ---------------------------------------------------------------------------------------------
# inputs


def forget_gate_g(case: dict[str, Any], tokens: int, gen: torch.Generator) -> torch.Tensor:
    """g [1, tokens, H, K] from HF's Glm5NextTextForgetGate with random weights (lower bound -5)."""
    if tokens == 0:  # HF's gate cannot reshape an empty batch ([1, 0, -1, K] is ambiguous)
        return torch.zeros(1, 0, H, case["k"])
    cfg = Glm5NextTextConfig(
        hidden_size=HIDDEN, linear_head_dim=case["k"], linear_num_heads=H, linear_lower_bound=LOWER_BOUND
    )
    gate = hf.Glm5NextTextForgetGate(cfg)
    with torch.no_grad():
        for lin in (gate.f_a_proj, gate.f_b_proj):
            bound = 1 / math.sqrt(lin.in_features)
            lin.weight.copy_((torch.rand(lin.weight.shape, generator=gen) * 2 - 1) * bound)
        lo, hi = (-8.0, 4.0) if case["gates"] == "mixed" else (-7.5, -4.5)
        gate.dt_bias.copy_(lo + (hi - lo) * torch.rand(gate.dt_bias.shape, generator=gen))
        gate.A_log.copy_(torch.log(0.5 + 1.5 * torch.rand(gate.A_log.shape, generator=gen)))
        hidden = 3.0 * torch.randn(1, tokens, HIDDEN, generator=gen)
        return gate(hidden)


def kda_inputs(case: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = case["t"] + case.get("decode", 0)
    k, v = case["k"], case["v"]
    inp = {
        "q": torch.randn(1, n, H, k, generator=gen),
        "k": torch.randn(1, n, H, k, generator=gen),
        "v": torch.randn(1, n, H, v, generator=gen),
        "beta": torch.sigmoid(1.5 * torch.randn(1, n, H, generator=gen)),
        "g": forget_gate_g(case, n, gen),
    }
    if not case.get("l2norm", True):  # no in-kernel norm: keep |k| ~ 1 so the delta rule stays contractive
        inp["q"] = inp["q"] / math.sqrt(k)
        inp["k"] = inp["k"] / math.sqrt(k)
    if case["state"]:
        inp["state0"] = torch.randn(1, H, k, v, generator=gen)
    return inp


# ---------------------------------------------------------------------------------------------
# float64 evaluations for the self-test


def kda_f64(inp: dict[str, np.ndarray], t0: int, t1: int, state: np.ndarray, l2norm: bool):
    """The KDA recurrence in float64 over tokens [t0, t1) (one sequence): -> (o [t1-t0, H, V], state)."""
    q, k, v, g, beta = (np.asarray(inp[n][0, t0:t1], np.float64) for n in ("q", "k", "v", "g", "beta"))
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q / math.sqrt(q.shape[-1])
    s = np.asarray(state, np.float64).copy()
    o = np.zeros(v.shape)
    for i in range(q.shape[0]):
        s = s * np.exp(g[i])[..., None]
        delta = (v[i] - np.einsum("hkv,hk->hv", s, k[i])) * beta[i][..., None]
        s = s + k[i][..., None] * delta[:, None, :]
        o[i] = np.einsum("hkv,hk->hv", s, q[i])
    return o, s


def conv_f64(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, activation: str | None
) -> np.ndarray:
    """Causal depthwise conv of the whole sequence x [B, C, T] from zeros, float64."""
    w = weight.shape[1]
    xp = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0), (w - 1, 0)))
    y = sum(weight[None, :, j, None].astype(np.float64) * xp[:, :, j : j + x.shape[2]] for j in range(w))
    if bias is not None:
        y = y + bias[None, :, None]
    return y / (1 + np.exp(-y)) if activation == "silu" else y


# ---------------------------------------------------------------------------------------------
# HF runs


def run_kda(case: dict[str, Any], seed: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    inp = kda_inputs(case, seed)
    t, d = case["t"], case.get("decode", 0)
    l2 = case.get("l2norm", True)
    state0 = inp.get("state0")
    first = {n: x[:, :t] for n, x in inp.items() if n != "state0"}
    kw = dict(initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    with torch.no_grad():
        o_rec, s_rec = hf.recurrent_kimi_delta_attention(
            first["q"], first["k"], first["v"], g=first["g"], beta=first["beta"], **kw
        )
        o_chunk, s_chunk = hf.chunk_kimi_delta_attention(
            first["q"], first["k"], first["v"], g=first["g"], beta=first["beta"],
            chunk_size=case.get("chunk", 64), **kw,
        )  # fmt: skip
        decode_o, s_dec = [], s_chunk
        for i in range(t, t + d):  # the layer's decode: one token at a time from the cached state
            o_i, s_dec = hf.recurrent_kimi_delta_attention(
                *(inp[n][:, i : i + 1] for n in ("q", "k", "v")),
                g=inp["g"][:, i : i + 1], beta=inp["beta"][:, i : i + 1],
                initial_state=s_dec, output_final_state=True, use_qk_l2norm_in_kernel=l2,
            )  # fmt: skip
            decode_o.append(o_i[0])

    arrays = {n: x[0].numpy() for n, x in inp.items()}
    arrays |= {"o_rec": o_rec[0], "s_rec": s_rec[0], "o_chunk": o_chunk[0], "s_chunk": s_chunk[0]}
    if d:
        arrays |= {"o_decode": torch.cat(decode_o), "s_decode": s_dec[0]}
    arrays = {n: np.asarray(x, np.float32) for n, x in arrays.items()}

    # float64 truth of the same recurrence: HF's float32 results must be well determined
    np_inp = {n: x.numpy() for n, x in inp.items()}
    s_init = np_inp["state0"][0] if state0 is not None else np.zeros((H, case["k"], case["v"]))
    o64, s64 = kda_f64(np_inp, 0, t, s_init, l2)
    errs = {
        "o_rec": rel(arrays["o_rec"], o64),
        "s_rec": rel(arrays["s_rec"], s64),
        "o_chunk": rel(arrays["o_chunk"], o64),
        "s_chunk": rel(arrays["s_chunk"], s64),
    }
    if d:
        od64, sd64 = kda_f64(np_inp, t, t + d, s64, l2)
        errs |= {"o_decode": rel(arrays["o_decode"], od64), "s_decode": rel(arrays["s_decode"], sd64)}
    bad = {n: e for n, e in errs.items() if not e <= MAX_F64_REL}
    if bad:
        raise AssertionError(f"{case['name']}: HF float32 vs float64 rel L2 above {MAX_F64_REL}: {bad}")
    g = arrays["g"]
    info = {
        "rel_vs_f64": {n: float(f"{e:.3g}") for n, e in errs.items()},
        "rel_rec_vs_chunk": float(f"{rel(arrays['o_chunk'], arrays['o_rec']):.3g}"),
        "g_min": float(g.min()) if g.size else None,
        "g_max": float(g.max()) if g.size else None,
        "g_frac_below_-4": float((g < -4).mean()) if g.size else None,
        "g_frac_above_-0.1": float((g > -0.1).mean()) if g.size else None,
    }
    return arrays, info


def run_conv(case: dict[str, Any], seed: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The short conv over consecutive calls, as Glm5NextTextLinearAttention.forward drives it."""
    gen = torch.Generator().manual_seed(seed)
    b, c, w = case["b"], case["c"], case["w"]
    total = sum(case["segments"])
    x = torch.randn(b, c, total, generator=gen)
    weight = torch.randn(c, w, generator=gen) / math.sqrt(w)
    bias = 0.5 * torch.randn(c, generator=gen) if case["bias"] else None
    act = case["activation"]
    cache = LinearAttentionLayer()
    ys, caches, kinds, pos = [], [], [], 0
    with torch.no_grad():
        for n in case["segments"]:
            x_i = x[:, :, pos : pos + n]
            if cache.is_conv_states_initialized[0] and n == 1:  # the layer's decode rule
                y_i = hf.causal_conv1d_update(
                    x_i, cache.conv_states[0], weight=weight, bias=bias, activation=act
                )
                kinds.append("update")
            else:
                full = cache.update_conv_state(x_i, 0, conv_kernel_size=w)
                y_i = hf.causal_conv1d_fn(full, weight=weight, bias=bias, activation=act)[:, :, -n:]
                kinds.append("prefill")
            ys.append(y_i)
            caches.append(cache.conv_states[0].clone())
            pos += n
    arrays = {"x": x, "y": torch.cat(ys, dim=-1), "weight": weight, "cache": torch.stack(caches)}
    if bias is not None:
        arrays["bias"] = bias
    arrays = {n: np.asarray(t.numpy(), np.float32) for n, t in arrays.items()}

    y64 = conv_f64(arrays["x"], arrays["weight"], arrays.get("bias"), act)
    err_y = rel(arrays["y"], y64)
    ends = np.cumsum(case["segments"])
    xpad = np.pad(arrays["x"], ((0, 0), (0, 0), (w, 0)))  # HF's cache: the last W inputs, zeros before x
    want_cache = np.stack([xpad[:, :, e : e + w] for e in ends])
    if not err_y <= MAX_CONV_REL or not np.array_equal(arrays["cache"], want_cache):
        raise AssertionError(f"{case['name']}: HF conv vs float64 rel L2 {err_y:.3g}, or its cache is off")
    return arrays, {"kinds": kinds, "rel_vs_f64": float(f"{err_y:.3g}")}


# ---------------------------------------------------------------------------------------------


def self_test_environment() -> None:
    """HF's functions must be their torch fallbacks (FLA / causal-conv1d kernels compute differently)."""
    for pkg in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(pkg) is not None:
            raise SystemExit(f"{pkg} is installed: HF would use its kernels, not the torch functions")
    for fn in (
        hf.recurrent_kimi_delta_attention,
        hf.chunk_kimi_delta_attention,
        hf.causal_conv1d_fn,
        hf.causal_conv1d_update,
    ):
        if inspect.unwrap(fn).__module__ != hf.__name__:
            raise SystemExit(f"{fn.__name__} does not resolve to modeling_glm5_next's torch function")


def make_all() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {"kda": {}, "conv": {}, "heads": H, "lower_bound": LOWER_BOUND, "seed": SEED}
    for i, case in enumerate(KDA_CASES):
        a, info = run_kda(case, SEED + i)
        arrays |= {f"{case['name']}.{n}": x for n, x in a.items()}
        defaults = {"chunk": 64, "l2norm": True, "decode": 0}
        meta["kda"][case["name"]] = defaults | case | {"seed": SEED + i} | info
    for i, case in enumerate(CONV_CASES):
        a, info = run_conv(case, SEED + 100 + i)
        arrays |= {f"{case['name']}.{n}": x for n, x in a.items()}
        meta["conv"][case["name"]] = case | {"seed": SEED + 100 + i} | info
    return arrays, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if transformers.__version__ != "5.23.0" or not torch.__version__.startswith("2.13.0"):
        print(
            f"WARNING: expected transformers 5.23.0 / torch 2.13.0, got {transformers.__version__} / "
            f"{torch.__version__}"
        )
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    self_test_environment()

    arrays, meta = make_all()
    again, _ = make_all()
    if again.keys() != arrays.keys() or any(not np.array_equal(again[n], arrays[n]) for n in arrays):
        raise AssertionError("a second run gave different arrays")
    for name, m in {**meta["kda"], **meta["conv"]}.items():
        print(f"{name}: {json.dumps({n: v for n, v in m.items() if n not in ('name', 'seed')})}")

    meta_out = {"hf_version": transformers.__version__, "torch_version": torch.__version__} | meta
    arrays |= {
        "meta": np.array(json.dumps(meta_out, sort_keys=True)),
        "hf_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
        "numpy_version": np.array(np.__version__),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "reference.npz"
    save_npz(path, arrays)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.3f} MB, {len(arrays)} arrays)")


if __name__ == "__main__":
    main()
