"""V4 attention (docs/models.md §3.3-§3.8): one shared K = V head, a sliding window and compressed entries.

Per query at position p the keys are the window's tokens ``(p - W, p]`` and, on compressed
layers, compressed entries: the indexer's top-k (CSA) or all complete ones (HCA). Each key subset
is attended separately through :func:`jaxdsa.ops.sparse_mla` (the value is the whole key row), and
:func:`jaxdsa.ops.merge_states` joins the subsets' normalized outputs by their log-sum-exps with
the per-head sink in the denominator, once:

    o = (e^{L_win} o_win + e^{L_cmp} o_cmp) / (e^{L_win} + e^{L_cmp} + e^{sink})

which is the single softmax over window + compressed keys + sink that HF computes. The output's
rotary dims are rotated back at the query position, then the grouped low-rank projection
(``wo_a`` per group of heads, ``wo_b`` over the concatenation) maps to the hidden size. On a mesh
the heads (and with them the groups, ``wo_a``'s rows and ``wo_b``'s input) split over TP, the rest
of the layer (the one K = V head, the compressors, the indexer's keys) is replicated.

Cache (:mod:`.family` lists it): ``window`` is a per-sequence ring of the last W (+ lookahead)
K = V rows; the compressor's ``*_state`` rings and ``*_entries`` pages (one row per m tokens) and,
on CSA layers, the indexer's ``index_state`` / ``index_keys`` (see :mod:`.compressor`). The window's
positions before the step come from the ring, the step's own from its rows (:mod:`.context`): two
parts of the one merge. With an FP8 cache the window and entry rows are MODEL1 parts
(:class:`~jaxdsa.layers.mla.LatentPages`) and the step's own rows are read back as the ring will
hold them, so every key a query sees is the stored one, whichever step wrote it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.cache import Cache, LayerPages
from jaxdsa.layers.indexer import KeyPages
from jaxdsa.layers.linear import Linear
from jaxdsa.layers.mla import LatentPages, fp8_parts
from jaxdsa.layers.norms import RMSNorm
from jaxdsa.layers.params import normal, zeros
from jaxdsa.models.deepseek_v4.compressor import Compressor
from jaxdsa.models.deepseek_v4.config import CSA, HCA, SWA, V4Config
from jaxdsa.models.deepseek_v4.context import V4Context
from jaxdsa.models.deepseek_v4.indexer import Indexer
from jaxdsa.models.deepseek_v4.rotary import rotate_tail

# Cache entries of a compressed layer of each kind: (compressor state, compressed entries).
COMPRESSED_ENTRIES = {CSA: ("csa_state", "csa_entries"), HCA: ("hca_state", "hca_entries")}


def window_positions(positions: jax.Array, window: int) -> jax.Array:
    """[T, W] key positions ``p - W + 1 .. p`` of each query's window; -1 before position 0."""
    keys = positions[:, None] - (window - 1) + jnp.arange(window, dtype=jnp.int32)[None, :]
    return jnp.where(keys >= 0, keys, -1)


def complete_entries(positions: jax.Array, entries: int, ratio: int) -> jax.Array:
    """[T, entries] every compressed entry a query may see (HCA): entry j, complete once position
    ``(j + 1) m - 1`` is, i.e. ``j < (p + 1) // m``; -1 otherwise."""
    j = jnp.arange(entries, dtype=jnp.int32)
    return jnp.where(j[None, :] < (positions[:, None] + 1) // ratio, j[None, :], -1)


class Attention(nnx.Module):
    def __init__(self, cfg: V4Config, kind: str, ratio: int, *, dtype, rngs: nnx.Rngs):
        D, H, d, g = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        q_lora, eps = cfg.q_lora_rank, cfg.rms_norm_eps
        self.wq_a = Linear((D,), (q_lora,), ("embed", "q_lora"), dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(q_lora, eps, axis="q_lora", dtype=dtype)
        self.wq_b = Linear((q_lora,), (H, d), ("q_lora", "heads", "head_dim"), dtype=dtype, rngs=rngs)
        self.wkv = Linear((D,), (d,), ("embed", "head_dim"), dtype=dtype, rngs=rngs)
        self.kv_norm = RMSNorm(d, eps, axis="head_dim", dtype=dtype)
        # wo_a [o_lora, H, d]: group k's [o_lora, H/g * d] matrix is its heads' [o_lora, d] blocks side by
        # side, so splitting heads over TP splits the groups with them (g < tp: a group's sum spans
        # shards). Each output row's inputs are contiguous, as in the checkpoint: at decode XLA turns the
        # projection into a row reduction that reads the weight once, where a [H, d, o_lora] layout made
        # it transpose the whole weight every step first.
        self.wo_a = normal(rngs, (cfg.o_lora_rank, H, d), H * d // g, dtype, ("o_lora", "heads", "head_dim"))
        self.wo_b = Linear((g * cfg.o_lora_rank,), (D,), ("o_rank", "embed"), dtype=dtype, rngs=rngs)
        self.o_groups = g
        self.sink = zeros((H,), jnp.float32, ("heads",))
        self.compressor = (
            None
            if kind == SWA
            else Compressor(
                D,
                d,
                ratio,
                overlap=kind == CSA,
                rope=cfg.compress_rope,
                rope_dims=cfg.qk_rope_head_dim,
                eps=eps,
                width_axis="head_dim",
                dtype=dtype,
                rngs=rngs,
            )
        )
        self.indexer = Indexer(cfg, ratio, dtype=dtype, rngs=rngs) if kind == CSA else None
        self.kind, self.ratio, self.window, self.eps = kind, ratio, cfg.sliding_window, eps
        self.softmax_scale = cfg.softmax_scale

    def __call__(self, x: jax.Array, ctx: V4Context, cache: Cache, rows: tuple) -> tuple[jax.Array, Cache]:
        """[T, D] normed input -> ([T, D], cache). ``rows`` = (this layer's row of ``window``, its row
        among the layers of its kind)."""
        cos, sin = ctx.main if self.kind == SWA else ctx.compress
        q_lat = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_lat)
        q32 = q.astype(jnp.float32)  # per-head RMS without weight
        q = (q32 * jax.lax.rsqrt(jnp.mean(q32 * q32, axis=-1, keepdims=True) + self.eps)).astype(q.dtype)
        q = rotate_tail(q, cos, sin)
        kv = rotate_tail(self.kv_norm(self.wkv(x)), cos, sin)
        attend = lambda rows, at: ops.sparse_mla(  # noqa: E731
            q, rows[0], at, sm_scale=self.softmax_scale, v_dim=q.shape[-1], **fp8_parts(rows)
        )
        window = LatentPages.of(cache, rows[0], "window")
        keys = window_positions(ctx.positions, self.window)
        parts = [
            attend(*window.flat(ctx.ring_slots(keys, window.page_size))),  # before the step: the ring
            attend((window.read_back(kv),), ctx.step_rows(keys)),  # the step's own rows
        ]
        cache = {**cache, **window.write(ctx.ring_writes(window.page_size), kv).entries()}
        if self.compressor is not None:
            state_name, entries_name = COMPRESSED_ENTRIES[self.kind]
            state, entries = self.compressor(
                x, ctx, LayerPages(cache[state_name], rows[1]), LatentPages.of(cache, rows[1], entries_name)
            )
            cache |= {state_name: state.stacked, **entries.entries()}
            if self.indexer is not None:
                picked, index_state, index_keys = self.indexer(
                    x, q_lat, ctx, LayerPages(cache["index_state"], rows[1]), KeyPages.of(cache, rows[1])
                )
                cache |= {"index_state": index_state.stacked, **index_keys.entries()}
            else:
                columns = ctx.meta.page_table.shape[1] * entries.page_size
                picked = complete_entries(ctx.positions, columns, self.ratio)
            parts.append(attend(*entries.flat(ctx.slots(picked, entries.page_size))))
        outs, lses = zip(*parts)
        o, _ = ops.merge_states(jnp.stack(outs), jnp.stack(lses), sink=self.sink[...])
        return self.output(o, cos, sin), cache

    def output(self, o: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Undo the value rows' RoPE at the query position, then the grouped low-rank projection."""
        o = rotate_tail(o, cos, sin, inverse=True)
        (T, H, d), g = o.shape, self.o_groups
        wo_a = self.wo_a[...].reshape(-1, g, H // g, d)
        z = jnp.einsum("tgjd,rgjd->tgr", o.reshape(T, g, H // g, d), wo_a)
        return self.wo_b(z.reshape(T, -1))
