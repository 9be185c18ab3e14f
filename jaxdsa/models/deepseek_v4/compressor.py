"""The KV compressor of CSA / HCA layers (docs/models.md §3.4): one entry per complete window of m tokens.

Per source token the compressor projects ``C = x wkv`` and gate logits ``Z = x wgate`` (float32,
width ``c * d``; c = 2 with overlapping windows, i.e. CSA); the token at offset o of its window
scores ``Z + ape[o]``. Entry j is the per-channel softmax-weighted sum of its window's rows (CSA:
the first d channels of window j - 1's rows and the last d channels of window j's rows, 2m slots),
RMSNorm'ed, then roped at position ``j * m`` (the window's first token) with the compress RoPE.

In the cache each token's source row ``[C | Z + ape]`` (float32) goes to a per-sequence ring of
``m`` rows (CSA: ``2 m``, the previous window too), plus the speculative lookahead, and entry j to
row j of the ``entries`` pages (one row per m tokens). The token completing a window (position
``(j + 1) m - 1``) pools its window's rows: those of earlier steps from the ring, those of this step
from the step's own rows (:mod:`.context`). This is the reference's carried state (the last
``T mod m`` rows, CSA's previous window) kept per position: a chunk may end anywhere inside a window,
and a speculative step's rejected rows are rewritten before they are read. ``entries`` are any pages
with ``write`` and ``page_size``: the attention's (:class:`~jaxdsa.layers.mla.LatentPages`, FP8
parts quantized as written) or the indexer's keys (:class:`~jaxdsa.layers.indexer.KeyPages`).
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.cache import LayerPages
from jaxdsa.config import RopeConfig
from jaxdsa.layers.linear import Linear
from jaxdsa.layers.norms import RMSNorm
from jaxdsa.layers.params import zeros
from jaxdsa.layers.rope import cos_sin
from jaxdsa.models.deepseek_v4.context import V4Context
from jaxdsa.models.deepseek_v4.rotary import rotate_tail

Pages = TypeVar("Pages")  # the entries' pages: LatentPages or KeyPages


class Compressor(nnx.Module):
    """``width``-wide entries of windows of ``ratio`` tokens; ``overlap``: CSA's two-window pooling."""

    def __init__(
        self,
        hidden: int,
        width: int,
        ratio: int,
        *,
        overlap: bool,
        rope: RopeConfig,
        rope_dims: int,
        eps: float,
        width_axis: str,
        dtype,
        rngs: nnx.Rngs,
    ):
        c = 2 if overlap else 1
        proj = dict(dtype=dtype, rngs=rngs, compute_dtype=jnp.float32)
        self.wkv = Linear((hidden,), (c * width,), ("embed", "compress_width"), **proj)
        self.wgate = Linear((hidden,), (c * width,), ("embed", "compress_width"), **proj)
        self.ape = zeros((ratio, c * width), jnp.float32, ("compress_window", "compress_width"))
        self.norm = RMSNorm(width, eps, axis=width_axis, dtype=dtype)
        self.ratio, self.overlap, self.rope, self.rope_dims, self.eps = ratio, overlap, rope, rope_dims, eps

    def __call__(
        self, x: jax.Array, ctx: V4Context, state: LayerPages, entries: Pages
    ) -> tuple[LayerPages, Pages]:
        """Write the entry of every window a token of the step completes, and the step's source rows."""
        m, positions = self.ratio, ctx.positions
        kv = self.wkv(x)
        rows = jnp.concatenate([kv, self.wgate(x) + self.ape[...][positions % m]], axis=-1)  # [T, 2 c d]
        # Only the tokens completing a window pool: at most T // m + (one per sequence) of them.
        T, B = positions.shape[0], ctx.meta.page_table.shape[0]
        complete = (ctx.meta.seq_ids >= 0) & (positions % m == m - 1)
        n = min(T, T // m + B)
        (at,) = jnp.nonzero(complete, size=n, fill_value=0)
        done = ctx.take(at, jnp.arange(n) < jnp.sum(complete))
        start = done.positions // m * m
        source = start[:, None] + jnp.arange(-m if self.overlap else 0, m, dtype=jnp.int32)[None, :]
        got = done.gather_rows(source, rows, state)  # [n, (1 | 2) m, 2 c d]
        valid = (source >= 0)[..., None]
        cd = kv.shape[-1]
        kv_rows = jnp.where(valid, got[..., :cd], 0.0)
        score_rows = jnp.where(valid, got[..., cd:], -jnp.inf)
        if self.overlap:  # previous window's first halves, then this window's second halves
            d = cd // 2
            kv_rows = jnp.concatenate([kv_rows[:, :m, :d], kv_rows[:, m:, d:]], axis=1)
            score_rows = jnp.concatenate([score_rows[:, :m, :d], score_rows[:, m:, d:]], axis=1)
        pooled = ops.compress_pool(kv_rows, score_rows, self.norm.weight[...], eps=self.eps)
        entry = rotate_tail(pooled, *cos_sin(start, self.rope, self.rope_dims))
        entries = entries.write(done.slots(done.positions // m, entries.page_size), entry)
        return state.write(ctx.ring_writes(state.page_size), rows), entries
