"""The one dispatch point for the hot operations of a DSA model: one table, one entry per op.

Model code calls only the functions below. Each entry of :data:`OPS` names the op's package
(imported statically, so go-to-definition works), its pure-JAX oracle (``ref.py``), its Pallas
kernel (``kernel.py``) and the logical axes of its operands, from which
:func:`jaxdsa.sharding.wrap_op` builds the shard_map that runs it on a mesh. Which
implementation runs is chosen in one place: ``JAXDSA_KERNELS=reference|interpret|pallas`` (read
once, at first use) or :func:`set_kernels`; the default is ``pallas`` on CUDA and ``reference``
elsewhere. ``interpret`` runs the Pallas kernel in the Pallas interpreter (CPU tests).

Shapes (legend in docs/architecture.md: T query tokens, H heads, Hi index heads, K selected keys,
S key positions, Z cache slots, P pages, B sequences, M page-table columns, E experts, D model width,
N expert width):

- ``sparse_mla(q [T,H,576], kv [Z,576], indices [T,K] int32, *, sm_scale, sink=None, v_dim=512,
  kv_scale=None, kv_rope=None) -> (out [T,H,v_dim], lse [T,H] f32)``: softmax attention of each
  query over the selected kv rows (-1 = skip, duplicates count twice); the value is the first
  ``v_dim`` columns of the row. With ``kv_scale [Z,v_dim/128] f32`` the rows are FP8 latent parts
  (:mod:`pallas_kernels.quant.kv_fp8`): ``kv [Z,v_dim]`` float8_e4m3fn values and ``kv_rope
  [Z,576-v_dim]`` bf16, decoded in the kernel (the reference dequantizes only the gathered rows).
- ``merge_states(outs [n,T,H,Dv], lses [n,T,H], sink=None) -> (out, lse)``: log-sum-exp merge.
- ``indexer_logits_paged(q [T,Hi,Di], w [T,Hi], k_pages [P,page,Di], page_table [B,M], seq_ids [T],
  q_pos [T], *, k_scale=None) -> [T, M*page] f32``: ``sum_h w[t,h] * relu(q[t,h] . k[s])`` over the
  query's own sequence's keys through the page table, for ``s <= q_pos[t]`` (-inf beyond);
  ``k_scale [P,page]`` marks fp8 keys (value = k * scale); seq_ids < 0 = padding.
- ``topk_indices(logits [T,S], k) -> [T,k] int32``: indices of the k largest finite values, any
  order, -1 where a row has fewer.
- ``select_experts(logits [T,E] f32, bias [E] f32, *, top_k, n_group, topk_group, norm_topk_prob,
  scaling, layer=None, shared_slot=None) -> (ids [T,k] int32, weights [T,k] f32)``: the MoE router after
  its logits (computed by the caller in XLA): sigmoid scores, selection on score + bias limited to
  the ``topk_group`` best of ``n_group`` groups (each scored by its top-2 sum), weights = the
  selected scores, normalized if ``norm_topk_prob``, times ``scaling``; k = top_k, and with
  ``shared_slot`` one more column routing every token to that expert at weight 1. Replicated on a mesh.
- ``mla_latent(x [T,D], (q_a, kv_a[, wk]), q_norm [Q], kv_norm [C], cos, sin [T,P/2], *, eps, layer=None)
  -> (q_lat [T,Q], row [T,C+P][, wk_x [T,d]])``: MLA's quantized latent projections with the norms
  and the latent key's interleaved RoPE after them (the projections' K splits added in the row kernel).
- ``mla_query(q_lat [T,Q], q_b [Q,H*(nope+P)], w_uk [C,H,nope], cos, sin [T,P/2], *, nope, layer=None)
  -> q [T,H,C+P]``: MLA's absorbed query from a quantized ``q_b`` and a dense ``w_uk``: ``[q_nope
  W_UK | RoPE(q_pe)]`` per head, interleaved RoPE (``q_b``'s K splits added in the kernel after it).
  Split by heads on a mesh (``q_b`` column-parallel); taken up to :data:`MLA_QUERY_MAX_TOKENS` tokens.
- ``moe_experts(x [T,D], topk_ids [T,k], topk_weights [T,k], experts, *, swiglu_limit=None, layer=None)
  -> [T,D]`` with ``experts = {'gate_up': [E,D,2N], 'down': [E,N,D]}``
  (:func:`pallas_kernels.moe.ref.pack_experts`; quantized experts: ``pack_experts`` of three
  ``QuantizedWeight`` stacks ``[E, in, out]``).
- ``quant_matmul(x [T,K], w: QuantizedWeight [K,N], *, axes=(k, n), layer=None) -> [T,N]``: ``x @ W``
  with W kept INT4 / FP8 / FP4 (``jaxdsa.quantized_weight``), dequantized in the kernel
  to x's dtype. Its sharding depends on the call site, so the caller passes W's logical axes: a
  split N (column-parallel) splits the output, a split K (row-parallel) splits x too and sums the
  partial products (:func:`quant_matmul_sharding`).
- ``quant_matmul_many(x [T,K], ws: tuple of QuantizedWeight [K,N_i], *, axes=((k, n_1), ...),
  layer=None) -> (x @ W_1, ...)``: projections of one input in one kernel launch where the weights
  allow it (one format; the kernels' :func:`~pallas_kernels.quant_matmul.kernel.groupable`), each
  weight split as its own axes say (they share K's).
- ``add_rms_norm(x [T,D], weight [D], *, eps, residual=None [T,D], layer=None) -> (normed [T,D],
  summed [T,D])``: RMSNorm of ``x + residual`` (HF's casting order), and the sum: a decoder layer's
  residual add and norm in one launch (``weight`` a ``[L, D]`` stack when given ``layer``).
- ``indexer_logits(q [T,Hi,Di], w [T,Hi], k [S,Di], *, q_pos [T]) -> [T,S] f32``: the same sum over one
  flat key sequence, ``s <= q_pos[t]`` (DeepSeek-V4's compressed keys).

``moe_experts`` and ``quant_matmul`` take their weights as whole stacks over scanned layers
(``gate_up [L,E,D,2N]``, ``w [L,K,N]``, ...) when given ``layer``, an int32 scalar (traced inside
``lax.scan``): the kernels read that layer in place, so the scan never copies a layer's weights
out of the stack for a custom call. On a mesh the stacks' leading dim is never split and the
index is replicated (:meth:`jaxdsa.sharding.OpSharding.with_layer_stacks`).

DeepSeek-V4 (docs/models.md §3; on a mesh these run replicated: V4's streams and compressors are):

- ``hc_pre(x [T,n,D], fn [nD,(2+n)n], base, scale [3], *, iters, hc_eps, norm_eps)
  -> (collapsed [T,D], post [T,n], comb [T,n,n])`` and ``hc_post(x, out [T,D], post, comb) -> [T,n,D]``:
  a hyper-connection site's weights (Sinkhorn-normalized mixing) and the stream update.
- ``compress_pool(kv [W,m,cd], score [W,m,cd], norm [d], *, eps, prev_kv=None, prev_score=None)
  -> [W,d]``: the compressor's gated per-channel softmax pooling of complete windows (c = 2:
  overlapping CSA windows, the previous window's first half carried in ``prev_*``), then RMSNorm.

GLM-5.3-Flash (docs/models.md §9; on a mesh each TP shard runs its part of the KDA heads Hl):

- ``kda_recurrent(q, k, g [T,Hl,Kl], v [T,Hl,Vl], beta [T,Hl], state [R,Hl,Kl,Vl] f32, *, seq_ids [T],
  rows [B], fresh [B] bool) -> (o [T,Hl,Vl], state)``: KDA's delta rule over a packed step, q and k
  L2-normalized inside, each sequence's tokens (contiguous, in order) advancing its state row
  ``rows[b]`` (from zeros where ``fresh``); o = 0 for padding.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax

# Pallas registers three trace-context config states in modules it imports lazily. When that first
# happens inside a jitted trace (the first kernel resolved by an interpret / pallas step), the next
# call of the same jitted function misses JAX's cache and compiles everything a second time.
# Importing them here, before any trace, keeps it to one compilation.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp

from jaxdsa.sharding import OpSharding, wrap_op
from pallas_kernels.compress_pool import kernel as compress_pool_kernel
from pallas_kernels.compress_pool import ref as compress_pool_ref
from pallas_kernels.indexer_logits import kernel as indexer_logits_kernel
from pallas_kernels.indexer_logits import ref as indexer_logits_ref
from pallas_kernels.kda import kernel as kda_kernel
from pallas_kernels.kda import ref as kda_ref
from pallas_kernels.merge_states import kernel as merge_states_kernel
from pallas_kernels.merge_states import ref as merge_states_ref
from pallas_kernels.mhc import kernel as mhc_kernel
from pallas_kernels.mhc import ref as mhc_ref
from pallas_kernels.mla_latent import kernel as mla_latent_kernel
from pallas_kernels.mla_latent import ref as mla_latent_ref
from pallas_kernels.mla_query import kernel as mla_query_kernel
from pallas_kernels.mla_query import ref as mla_query_ref
from pallas_kernels.moe import kernel as moe_kernel
from pallas_kernels.moe import ref as moe_ref
from pallas_kernels.quant_matmul import kernel as quant_matmul_kernel
from pallas_kernels.quant_matmul import ref as quant_matmul_ref
from pallas_kernels.rms_norm import kernel as rms_norm_kernel
from pallas_kernels.rms_norm import ref as rms_norm_ref
from pallas_kernels.router import kernel as router_kernel
from pallas_kernels.router import ref as router_ref
from pallas_kernels.sparse_mla import kernel as sparse_mla_kernel
from pallas_kernels.sparse_mla import ref as sparse_mla_ref
from pallas_kernels.topk import kernel as topk_kernel
from pallas_kernels.topk import ref as topk_ref

BACKENDS = ("reference", "interpret", "pallas")


@dataclasses.dataclass(frozen=True)
class Op:
    """One hot operation: its oracle, its kernel (same signature plus ``interpret``), its sharding."""

    reference: Callable[..., Any]
    kernel: Callable[..., Any]
    sharding: OpSharding | None  # None: the caller places it (no shard_map here)
    weights: tuple[int, ...] = ()  # positions of the weight operands that may come as layer stacks


_EXPERTS = {"gate_up": ("experts", None, "expert_mlp"), "down": ("experts", "expert_mlp", None)}
_KDA_HEADS = (None, "linear_heads", None)  # q, k, v, g and o [T, H, K]
_KDA_STATE = (None, "linear_heads", None, None)  # the state buffer [R, H, K, V]

OPS: dict[str, Op] = {
    "sparse_mla": Op(
        sparse_mla_ref.sparse_mla,
        sparse_mla_kernel.sparse_mla,
        OpSharding(
            args=((None, "heads", None), None, None),
            kwargs={"sink": ("heads",), "kv_scale": None, "kv_rope": None},
            out=((None, "heads", None), (None, "heads")),
        ),
    ),
    "merge_states": Op(
        merge_states_ref.merge_states,
        merge_states_kernel.merge_states,
        OpSharding(
            args=((None, None, "heads", None), (None, None, "heads")),
            kwargs={"sink": ("heads",)},
            out=((None, "heads", None), (None, "heads")),
        ),
    ),
    # Index heads are split over TP: each shard sums its heads, one psum adds the shards.
    "indexer_logits_paged": Op(
        indexer_logits_ref.indexer_logits_paged,
        indexer_logits_kernel.indexer_logits_paged,
        OpSharding(
            args=((None, "index_heads", None), (None, "index_heads"), None, None, None, None),
            kwargs={"k_scale": (None, None)},
            out=(None, None),
            reduce=("index_heads",),
        ),
    ),
    "topk_indices": Op(
        topk_ref.topk_indices, topk_kernel.topk_indices, OpSharding(args=(None,), out=(None, None))
    ),
    # The router scores every expert on every device (``router_experts`` is never split).
    "select_experts": Op(
        router_ref.select_experts,
        router_kernel.select_experts,
        OpSharding(args=(None, None), out=None),
        weights=(1,),
    ),
    # Expert parallelism without all-to-all: tokens are replicated over the expert axes, each
    # shard runs the slots routed to its own experts (ids shifted into its range, the others
    # drop out) and a psum adds the shards and the partial down-projections of expert-TP shards.
    "moe_experts": Op(
        moe_ref.moe_experts,
        moe_kernel.moe_experts,
        OpSharding(
            args=(None, None, None, _EXPERTS),
            out=(None, None),
            reduce=("experts", "expert_mlp"),
            index_args={1: "experts"},
            across_dp="gather_tokens",
        ),
        weights=(3,),
    ),
    "quant_matmul": Op(quant_matmul_ref.quant_matmul, quant_matmul_kernel.quant_matmul, None, weights=(1,)),
    "quant_matmul_many": Op(
        quant_matmul_ref.quant_matmul_many, quant_matmul_kernel.quant_matmul_many, None, weights=(1,)
    ),
    # Activations are whole on every device (TP) or the caller's dp group's (dp attention).
    "add_rms_norm": Op(
        rms_norm_ref.add_rms_norm,
        rms_norm_kernel.add_rms_norm,
        OpSharding(
            args=((None, None), (None,)), kwargs={"residual": (None, None)}, out=((None, None), (None, None))
        ),
        weights=(1,),
    ),
    "indexer_logits": Op(
        indexer_logits_ref.indexer_logits,
        indexer_logits_kernel.indexer_logits,
        OpSharding(
            args=((None, "index_heads", None), (None, "index_heads"), None),
            kwargs={"q_pos": (None,)},
            out=(None, None),
            reduce=("index_heads",),
        ),
    ),
    # MLA's latent projections are replicated over TP (every device projects its rows whole).
    "mla_latent": Op(
        mla_latent_ref.mla_latent,
        mla_latent_kernel.mla_latent,
        OpSharding(args=(None,) * 6, out=None),
        weights=(1, 2, 3),
    ),
    # MLA's absorbed query is split by heads: q_b column-parallel, W_UK [C, H, nope] and the query.
    "mla_query": Op(
        mla_query_ref.mla_query,
        mla_query_kernel.mla_query,
        OpSharding(
            args=(None, ("q_lora", "heads"), ("kv_lora", "heads", "head_dim"), None, None),
            out=(None, "heads", None),
        ),
        weights=(1, 2),
    ),
    # DeepSeek-V4's residual streams, compressors and their state are replicated over TP: every
    # device runs these on whole operands (declared, so a kernel is never left to the partitioner).
    "hc_pre": Op(mhc_ref.hc_pre, mhc_kernel.hc_pre, OpSharding(args=(None,) * 4, out=None)),
    "hc_post": Op(mhc_ref.hc_post, mhc_kernel.hc_post, OpSharding(args=(None,) * 4, out=None)),
    "compress_pool": Op(
        compress_pool_ref.compress_pool,
        compress_pool_kernel.compress_pool,
        OpSharding(args=(None,) * 3, kwargs={"prev_kv": None, "prev_score": None}, out=None),
    ),
    # KDA heads are independent: each TP shard runs its own heads on its rows of the state buffer.
    "kda_recurrent": Op(
        kda_ref.recurrent_packed,
        kda_kernel.recurrent_packed,
        OpSharding(
            args=(*(_KDA_HEADS,) * 4, (None, "linear_heads"), _KDA_STATE),
            kwargs={"seq_ids": None, "rows": None, "fresh": None},
            out=(_KDA_HEADS, _KDA_STATE),
        ),
    ),
}

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


def _fn(name: str, backend: str) -> Callable[..., Any]:
    op = OPS[name]
    return (
        op.reference
        if backend == "reference"
        else functools.partial(op.kernel, interpret=backend == "interpret")
    )


def _wrapped(name: str, backend: str, sharding: OpSharding, stacked: bool) -> Callable[..., Any]:
    """Op ``name`` on ``backend`` under the shard_map of ``sharding``; ``stacked``: its weights come
    as layer stacks."""
    if stacked:
        sharding = sharding.with_layer_stacks(*OPS[name].weights)
    return wrap_op(sharding, _fn(name, backend))


@functools.cache
def _impl(name: str, backend: str, stacked: bool = False) -> Callable[..., Any]:
    """The op on ``backend``, under its own sharding's shard_map (none declared: as it is)."""
    op = OPS[name]
    if op.sharding is None:
        return _fn(name, backend)
    return _wrapped(name, backend, op.sharding, stacked)


def sparse_mla(q, kv, indices, *, sm_scale: float, sink=None, v_dim: int = 512, kv_scale=None, kv_rope=None):
    return _impl("sparse_mla", get_kernels())(
        q, kv, indices, sm_scale=sm_scale, sink=sink, v_dim=v_dim, kv_scale=kv_scale, kv_rope=kv_rope
    )


def merge_states(outs, lses, sink=None):
    return _impl("merge_states", get_kernels())(outs, lses, sink=sink)


def indexer_logits_paged(q, w, k_pages, page_table, seq_ids, q_pos, *, k_scale=None):
    return _impl("indexer_logits_paged", get_kernels())(
        q, w, k_pages, page_table, seq_ids, q_pos, k_scale=k_scale
    )


def topk_indices(logits, k: int):
    return _impl("topk_indices", get_kernels())(logits, k)


def select_experts(
    logits,
    bias,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    layer=None,
    shared_slot: int | None = None,
):
    impl, at = _at_layer("select_experts", layer)
    return impl(
        logits,
        bias,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        scaling=scaling,
        shared_slot=shared_slot,
        **at,
    )


# The column a router adds for a shared expert held as one more routed expert (the router kernel
# writes it itself; routers computed in XLA, DeepSeek-V4's, add it with this).
with_shared_column = router_ref.with_shared_column


def moe_experts(
    x, topk_ids, topk_weights, experts, *, swiglu_limit: float | None = None, layer=None, unreduced=False
):
    """``unreduced``: the expert shards' partial sums as a :class:`jaxdsa.sharding.Partial`."""
    impl, at = _at_layer("moe_experts", layer)
    return impl(x, topk_ids, topk_weights, experts, swiglu_limit=swiglu_limit, unreduced=unreduced, **at)


def quant_matmul_sharding(k: str | None, n: str | None) -> OpSharding:
    """How ``x [T, K] @ W [K, N]`` splits when W's dims carry the logical names ``k`` and ``n``: one
    spec for every leaf of W (codes, scales and zero points share their axes)."""
    return OpSharding(args=((None, k), (k, n)), out=(None, n), reduce=(k,) if k else ())


@functools.cache
def _quant_matmul_impl(backend: str, k: str | None, n: str | None, stacked: bool) -> Callable[..., Any]:
    return _wrapped("quant_matmul", backend, quant_matmul_sharding(k, n), stacked)


def quant_matmul(x, w, *, axes: tuple[str | None, str | None] = (None, None), layer=None, unreduced=False):
    """``unreduced``: with K split, the shards' partial sums as a :class:`jaxdsa.sharding.Partial`."""
    if layer is None:
        return _quant_matmul_impl(get_kernels(), *axes, False)(x, w, unreduced=unreduced)
    return _quant_matmul_impl(get_kernels(), *axes, True)(x, w, layer=_index(layer), unreduced=unreduced)


@functools.cache
def _quant_matmul_many_impl(
    backend: str, k: str | None, ns: tuple[str | None, ...], stacked: bool
) -> Callable[..., Any]:
    sharding = OpSharding(
        args=((None, k), tuple((k, n) for n in ns)),
        out=tuple((None, n) for n in ns),
        reduce=(k,) if k else (),
    )
    return _wrapped("quant_matmul_many", backend, sharding, stacked)


def quant_matmul_many(x, ws, *, axes: tuple[tuple[str | None, str | None], ...], layer=None):
    k = axes[0][0]
    if any(a[0] != k for a in axes):
        raise ValueError(f"quant_matmul_many: the weights' K axes differ: {axes}")
    ns = tuple(a[1] for a in axes)
    if layer is None:
        return _quant_matmul_many_impl(get_kernels(), k, ns, False)(x, tuple(ws))
    return _quant_matmul_many_impl(get_kernels(), k, ns, True)(x, tuple(ws), layer=_index(layer))


def _at_layer(name: str, layer) -> tuple[Callable[..., Any], dict[str, jax.Array]]:
    """Op ``name`` and its ``layer`` keyword: with a layer index, the op that takes its weights as
    whole layer stacks (:attr:`Op.weights`) and the index to read them at; without, the plain op."""
    if layer is None:
        return _impl(name, get_kernels()), {}
    return _impl(name, get_kernels(), stacked=True), {"layer": _index(layer)}


def _index(layer) -> jax.Array:
    """A layer index as the int32 scalar array the ops' shard_maps and kernels take."""
    return jnp.asarray(layer, jnp.int32)


def mla_latent(x, ws, q_norm, kv_norm, cos, sin, *, eps: float, layer=None):
    impl, at = _at_layer("mla_latent", layer)
    return impl(x, tuple(ws), q_norm, kv_norm, cos, sin, eps=eps, **at)


# Tokens up to which MLAttention builds its absorbed queries with ``mla_query``: decode steps (more
# rows re-read W_UK once per row tile in the kernel, where XLA's einsum reads it once).
MLA_QUERY_MAX_TOKENS = mla_query_kernel.MAX_ROWS


def mla_query(q_lat, q_b, w_uk, cos, sin, *, nope: int, layer=None):
    impl, at = _at_layer("mla_query", layer)
    return impl(q_lat, q_b, w_uk, cos, sin, nope=nope, **at)


def add_rms_norm(x, weight, *, eps: float, residual=None, layer=None):
    impl, at = _at_layer("add_rms_norm", layer)
    return impl(x, weight, eps=eps, residual=residual, **at)


def indexer_logits(q, w, k, *, q_pos):
    return _impl("indexer_logits", get_kernels())(q, w, k, q_pos=q_pos)


def hc_pre(x, fn, base, scale, *, iters: int, hc_eps: float, norm_eps: float):
    return _impl("hc_pre", get_kernels())(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)


def hc_post(x, out, post, comb):
    return _impl("hc_post", get_kernels())(x, out, post, comb)


def compress_pool(kv, score, norm, *, eps: float, prev_kv=None, prev_score=None):
    return _impl("compress_pool", get_kernels())(
        kv, score, norm, eps=eps, prev_kv=prev_kv, prev_score=prev_score
    )


def kda_recurrent(q, k, v, g, beta, state, *, seq_ids, rows, fresh):
    return _impl("kda_recurrent", get_kernels())(
        q, k, v, g, beta, state, seq_ids=seq_ids, rows=rows, fresh=fresh
    )
