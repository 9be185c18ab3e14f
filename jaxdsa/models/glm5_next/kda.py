"""GLM-5.3-Flash's KDA (Kimi Delta Attention) layer (docs/models.md §9.3), over a packed step.

``[q; k; v] = SiLU(CausalConv1d([Wq x; Wk x; Wv x]))`` (depthwise, ``W`` taps, float32 weights), a
per-channel log decay ``g = lb * sigmoid(exp(A_log) * (f_b f_a x + dt_bias))`` (unbounded form without
``lb``), ``beta = sigmoid(b_proj x)``, the delta rule (:func:`jaxdsa.ops.kda_recurrent`: q and k
L2-normalized inside, float32 state ``[H, K, V]`` a sequence), a gated RMSNorm per head and ``o_proj``.

The cache (:mod:`.family`) holds per sequence and KDA layer the state (``kda_state``, one row of
``H K V`` float32 values) and the last ``W - 1`` convolution inputs (``kda_conv``, a ring in the model's
dtype): a step reads them by segment (:mod:`jaxdsa.layers.segments`) and leaves them advanced past its
tokens, so a chunked prefill or a decode step continues where the last step of that sequence stopped.
A sequence whose tokens start at position 0 starts from a zero state (a recomputed, preempted request
included).

On a mesh the heads split over TP like MLA's (``linear_heads``): each device holds its heads' part of
the q, k, v and beta projections, of the gates' up projections (``f_b``, ``g_b``), of the conv weights,
``dt_bias`` and ``A_log``, runs the conv, the recurrence and the gated norm on them, holds their part of
``kda_state`` and ``kda_conv``, and ``o_proj`` is row-parallel (one all-reduce, in float32, as MLA's).
The gates' down projections (the rank-K bottleneck) and ``o_norm`` (per head dim) are replicated. The
conv rows are kept head-major (each head's q, k, v channels together) so that a contiguous split of the
ring's width is whole heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops
from jaxdsa.cache import Cache, LayerPages
from jaxdsa.layers.linear import Linear, project
from jaxdsa.layers.params import ones, zeros
from jaxdsa.models.glm5_next.config import Glm5NextConfig
from jaxdsa.models.glm5_next.context import Glm5NextContext
from jaxdsa.sharding import constrain, reduce_partials

F32 = jnp.float32
HEADS = ("embed", "linear_heads", "linear_head_dim")
RANK_HEADS = ("linear_rank", "linear_heads", "linear_head_dim")


class KdaAttention(nnx.Module):
    def __init__(self, cfg: Glm5NextConfig, *, dtype, rngs: nnx.Rngs):
        D, H, K, W = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
        proj = lambda out, axes: Linear((D,), out, axes, dtype=dtype, rngs=rngs)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = (proj((H, K), HEADS) for _ in range(3))
        conv_axes = ("linear_heads", "linear_head_dim", "conv_taps")
        self.q_conv, self.k_conv, self.v_conv = (zeros((H, K, W), F32, conv_axes) for _ in range(3))
        self.f_a = proj((K,), ("embed", "linear_rank"))
        self.f_b = Linear((K,), (H, K), RANK_HEADS, dtype=dtype, rngs=rngs)
        self.dt_bias = zeros((H, K), F32, ("linear_heads", "linear_head_dim"))
        self.a_log = zeros((H,), F32, ("linear_heads",))
        self.b_proj = proj((H,), ("embed", "linear_heads"))
        self.g_a = proj((K,), ("embed", "linear_rank"))
        self.g_b = Linear((K,), (H, K), RANK_HEADS, dtype=dtype, rngs=rngs)
        self.o_norm = ones((K,), dtype, ("linear_head_dim",))
        self.o_proj = Linear(
            (H, K), (D,), ("linear_heads", "linear_head_dim", "embed"), dtype=dtype, rngs=rngs
        )
        self.lower_bound, self.eps = cfg.linear_lower_bound, cfg.rms_norm_eps

    def decay(self, x: jax.Array) -> jax.Array:
        """The log decay g [T, H, K] (float32; HF's ``Glm5NextTextForgetGate``)."""
        f = self.f_b(self.f_a(x)).astype(F32) + self.dt_bias[...]
        rate = jnp.exp(self.a_log[...])[:, None]
        if self.lower_bound is not None:
            return self.lower_bound * jax.nn.sigmoid(rate * f)
        return -rate * jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(jnp.minimum(f, 20.0))))

    def convolve(self, mixed: jax.Array, ctx: Glm5NextContext, conv: LayerPages) -> jax.Array:
        """SiLU of the causal depthwise conv over each token's last W inputs ``mixed [T, H 3 K]`` (head-major;
        earlier steps' from the ring, zeros before position 0), in float32 like HF's float32 weights."""
        weight = jnp.stack([w[...] for w in (self.q_conv, self.k_conv, self.v_conv)], axis=1)  # [H, 3, K, W]
        taps = weight.shape[-1]
        weight = weight.reshape(-1, taps)
        window = ctx.positions[:, None] + jnp.arange(1 - taps, 1, dtype=jnp.int32)[None, :]
        rows = ctx.gather_rows(window, mixed, conv).astype(F32)  # [T, W, H 3 K]
        return jax.nn.silu(jnp.einsum("twc,cw->tc", rows, weight)).astype(mixed.dtype)

    def __call__(self, x: jax.Array, ctx: Glm5NextContext, cache: Cache, row) -> tuple[jax.Array, Cache]:
        """x [T, D] (the normed layer input) -> (out [T, D] float32, all-reduced over the head shards;
        cache); ``row``: this layer's row among the KDA layers of the cache."""
        T, (H, K) = x.shape[0], self.q_proj.out_shape
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        mixed = constrain(jnp.stack([q, k, v], axis=2).reshape(T, H * 3 * K), (None, "linear_heads"))
        conv = LayerPages(cache["kda_conv"], row)
        q, k, v = jnp.unstack(self.convolve(mixed, ctx, conv).reshape(T, H, 3, K), axis=2)
        conv = conv.write(ctx.ring_writes(conv.page_size), mixed)

        state = cache["kda_state"]  # [L, B, R, H K K]: row 0 of a ring, R - 1 speculative spares unused
        L, B, R, _ = state.shape
        rows = (row * B + jnp.arange(B, dtype=jnp.int32)) * R
        beta = jax.nn.sigmoid(self.b_proj(x))
        o, flat = ops.kda_recurrent(
            q, k, v, self.decay(x), beta, state.reshape(L * B * R, H, K, K),
            seq_ids=ctx.meta.seq_ids, rows=rows, fresh=ctx.fresh,
        )  # fmt: skip
        cache = cache | {"kda_conv": conv.stacked, "kda_state": flat.reshape(state.shape)}
        return reduce_partials(self.o_proj.unreduced(self.gated_norm(o, self.g_b(self.g_a(x))))), cache

    def gated_norm(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        """HF's ``Glm5NextTextRMSNormGated``: per head, float32, weight then ``sigmoid(gate)``."""
        o32 = o.astype(F32)
        normed = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + self.eps)
        return (self.o_norm[...].astype(F32) * normed * jax.nn.sigmoid(gate.astype(F32))).astype(o.dtype)
