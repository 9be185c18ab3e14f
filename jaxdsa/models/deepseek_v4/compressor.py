"""The KV compressor of CSA / HCA layers (models.md §3.4): one entry per complete window of m tokens.

Per source token the compressor projects ``C = x wkv`` and gate logits ``Z = x wgate`` (float32,
width ``c * d``; c = 2 with overlapping windows, i.e. CSA); the token at offset o of its window
scores ``Z + ape[o]``. Entry j is the per-channel softmax-weighted sum of its window's rows (CSA:
the first d channels of window j - 1's rows and the last d channels of window j's rows, 2m slots),
RMSNorm'ed, then roped at position ``j * m`` (the window's first token) with the compress RoPE.

Over the paged cache nothing is carried per sequence. Each token writes its own source row
``[C | Z + ape]`` (float32) at its own slot of the ``state`` pages, and the token that completes a
window (position ``(j + 1) m - 1``) reads its window's rows back (CSA: and the previous window's),
pools them and writes entry j at **its own** slot of the ``entries`` pages. What the reference keeps
as the compressor's carried state (the last ``T mod m`` rows, CSA's previous window) is thus the
last rows of the state pages: a chunk may end anywhere inside a window, a prefix-cached page holds
only what its own tokens determine, and a preempted sequence is recomputed like any other.
"""

from __future__ import annotations

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
        self, x: jax.Array, ctx: V4Context, state: LayerPages, entries: LayerPages
    ) -> tuple[LayerPages, LayerPages]:
        """Write the step's source rows, then the entry of every window a token of the step completes."""
        m, positions, page = self.ratio, ctx.positions, state.page_size
        kv = self.wkv(x)
        score = self.wgate(x) + self.ape[...][positions % m]
        slots = ctx.slots(positions, page)
        state = state.write(slots, jnp.concatenate([kv, score], axis=-1))
        # Each token reads its own window (CSA: and the one before), rows past itself masked out.
        start = positions // m * m
        rows = start[:, None] + jnp.arange(-m if self.overlap else 0, m, dtype=jnp.int32)[None, :]
        valid = ((rows >= 0) & (rows <= positions[:, None]))[..., None]
        flat, at = state.rows(ctx.slots(rows, page))
        got = flat[jnp.maximum(at, 0)].astype(jnp.float32)  # [T, (1 | 2) m, 2 c d]
        cd = kv.shape[-1]
        kv_rows = jnp.where(valid, got[..., :cd], 0.0)
        score_rows = jnp.where(valid, got[..., cd:], -jnp.inf)
        if self.overlap:  # previous window's first halves, then this window's second halves
            d = cd // 2
            kv_rows = jnp.concatenate([kv_rows[:, :m, :d], kv_rows[:, m:, d:]], axis=1)
            score_rows = jnp.concatenate([score_rows[:, :m, :d], score_rows[:, m:, d:]], axis=1)
        pooled = ops.compress_pool(kv_rows, score_rows, self.norm.weight[...], eps=self.eps)
        entry = rotate_tail(pooled, *cos_sin(start, self.rope, self.rope_dims))
        complete = positions % m == m - 1
        return state, entries.write(jnp.where(complete, slots, -1), entry)
