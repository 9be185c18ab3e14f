"""The one dispatch point for the hot operations of a DSA model.

Model code calls only these functions; which implementation runs is chosen in one place:
``JAXDSA_KERNELS=reference|interpret|pallas`` (read once, at first use) or :func:`set_kernels`.
The default is ``pallas`` on CUDA and ``reference`` elsewhere.

- ``reference``: the pure-JAX oracle in ``pallas_kernels/<name>/ref.py``.
- ``interpret``: the Pallas kernel run by the Pallas interpreter (CPU tests).
- ``pallas``: the Pallas kernel lowered through the Triton GPU backend.

Shapes (T query tokens, H heads, K selected keys, N cache slots, S key positions):

- ``sparse_mla(q [T,H,576], kv [N,576], indices [T,K] int32, *, sm_scale, sink=None, v_dim=512)
  -> (out [T,H,v_dim], lse [T,H] f32)``: softmax attention of each query over the selected kv rows
  (-1 = skip, duplicates count twice); the value is the first ``v_dim`` columns of the row.
- ``merge_states(outs [n,T,H,D], lses [n,T,H], sink=None) -> (out, lse)``: log-sum-exp merge.
- ``indexer_logits(q [T,Hi,D], w [T,Hi], k [S,D], *, q_pos [T]) -> [T,S] f32``:
  ``sum_h w[t,h] * relu(q[t,h] . k[s])`` for ``s <= q_pos[t]``, -inf beyond.
- ``indexer_logits_paged(q, w, k_pages [P,page,D], page_table [B,M], seq_ids [T], q_pos [T],
  *, k_scale=None) -> [T, M*page] f32``: the same per query over its own sequence's keys through
  the page table; ``k_scale [P,page]`` marks fp8 keys (value = k * scale); seq_ids < 0 = padding.
- ``topk_indices(logits [T,S], k) -> [T,k] int32``: indices of the k largest finite values, any
  order, -1 where a row has fewer.
- ``pack_experts(gate [E,N,D], up [E,N,D], down [E,D,N]) -> experts`` and
  ``moe_experts(x [T,D], topk_ids [T,k], topk_weights [T,k], experts, *, swiglu_limit=None) -> [T,D]``;
  quantized experts: ``pack_experts`` of three ``QuantizedWeight`` stacks ``[E, in, out]``.
- ``quant_matmul(x [M,K], w: QuantizedWeight [K,N]) -> [M,N]``: ``x @ W`` with W kept INT4 / FP8 /
  FP4 (``pallas_kernels.quant_matmul.layout``), dequantized in the kernel to x's dtype. Not wrapped
  in a ``shard_map``: the caller (a Linear) knows whether W is split along K or N and runs it under
  its own specs.

DeepSeek-V4 (models.md §3):

- ``hc_pre(x [T,n,D], fn [nD,(2+n)n], base, scale [3], *, iters, hc_eps, norm_eps)
  -> (collapsed [T,D], post [T,n], comb [T,n,n])`` and ``hc_post(x, out [T,D], post, comb) -> [T,n,D]``:
  a hyper-connection site's weights (Sinkhorn-normalized mixing) and the stream update.
- ``compress_pool(kv [W,m,cd], score [W,m,cd], norm [d], *, eps, prev_kv=None, prev_score=None)
  -> [W,d]``: the compressor's gated per-channel softmax pooling of complete windows (c = 2:
  overlapping CSA windows, the previous window's first half carried in ``prev_*``), then RMSNorm.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import jax

# Pallas registers three trace-context config states in modules it imports lazily. When that first
# happens inside a jitted trace (the first kernel resolved by an interpret / pallas step), the next
# call of the same jitted function misses JAX's cache and compiles everything a second time.
# Importing them here, before any trace, keeps it to one compilation.
import jax.experimental.pallas.fuser  # noqa: F401

from jaxdsa import sharding

BACKENDS = ("reference", "interpret", "pallas")

# op name -> package under pallas_kernels/ holding ref.py (and kernel.py once written)
_PACKAGES = {
    "sparse_mla": "sparse_mla",
    "merge_states": "merge_states",
    "indexer_logits": "indexer_logits",
    "indexer_logits_paged": "indexer_logits",
    "topk_indices": "topk",
    "moe_experts": "moe",
    "pack_experts": "moe",
    "quant_matmul": "quant_matmul",
    "hc_pre": "mhc",
    "hc_post": "mhc",
    "compress_pool": "compress_pool",
}
# Not run under jaxdsa.sharding's shard_map rules: pack_experts builds a pytree; quant_matmul's caller
# (a Linear) knows whether W is split along K or N; the DeepSeek-V4 per-token ops have no sharding rule
# yet and run on whatever their inputs hold (meshes for V4 come with its model-family seam).
_UNSHARDED = {"pack_experts", "quant_matmul", "hc_pre", "hc_post", "compress_pool"}

_backend: str | None = None


def _default_backend() -> str:
    return "pallas" if jax.default_backend() in ("gpu", "cuda") else "reference"


def get_kernels() -> str:
    """The active backend; resolves ``JAXDSA_KERNELS`` on first call."""
    global _backend
    if _backend is None:
        choice = os.environ.get("JAXDSA_KERNELS", "").strip().lower() or _default_backend()
        if choice not in BACKENDS:
            raise ValueError(f"JAXDSA_KERNELS={choice!r}: choose one of {', '.join(BACKENDS)}")
        _backend = choice
    return _backend


def set_kernels(name: str) -> None:
    """Switch backend. Clears JAX's compilation caches so jitted steps retrace with it."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != _backend:
        _backend = name
        jax.clear_caches()


@functools.cache
def _resolve(op: str, backend: str) -> Callable[..., Any]:
    package = f"pallas_kernels.{_PACKAGES[op]}"
    if backend == "reference":
        return getattr(importlib.import_module(f"{package}.ref"), op)
    fn = getattr(importlib.import_module(f"{package}.kernel"), op)
    return functools.partial(fn, interpret=backend == "interpret")


def _impl(op: str) -> Callable[..., Any]:
    fn = _resolve(op, get_kernels())
    return fn if op in _UNSHARDED else sharding.wrap_op(op, fn)


def sparse_mla(q, kv, indices, *, sm_scale: float, sink=None, v_dim: int = 512):
    return _impl("sparse_mla")(q, kv, indices, sm_scale=sm_scale, sink=sink, v_dim=v_dim)


def merge_states(outs, lses, sink=None):
    return _impl("merge_states")(outs, lses, sink=sink)


def indexer_logits(q, w, k, *, q_pos):
    return _impl("indexer_logits")(q, w, k, q_pos=q_pos)


def indexer_logits_paged(q, w, k_pages, page_table, seq_ids, q_pos, *, k_scale=None):
    return _impl("indexer_logits_paged")(q, w, k_pages, page_table, seq_ids, q_pos, k_scale=k_scale)


def topk_indices(logits, k: int):
    return _impl("topk_indices")(logits, k)


def pack_experts(gate, up, down):
    return _impl("pack_experts")(gate, up, down)


def moe_experts(x, topk_ids, topk_weights, experts, *, swiglu_limit: float | None = None):
    return _impl("moe_experts")(x, topk_ids, topk_weights, experts, swiglu_limit=swiglu_limit)


def quant_matmul(x, w):
    return _impl("quant_matmul")(x, w)


def hc_pre(x, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float):
    return _impl("hc_pre")(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)


def hc_post(x, out, post, comb):
    return _impl("hc_post")(x, out, post, comb)


def compress_pool(kv, score, norm, *, eps: float, prev_kv=None, prev_score=None):
    return _impl("compress_pool")(kv, score, norm, eps=eps, prev_kv=prev_kv, prev_score=prev_score)
