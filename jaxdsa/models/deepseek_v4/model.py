"""The DeepSeek-V4 decoder as Flax NNX modules, one step over a packed batch and the paged cache.

``V4Model(tokens, positions, cache, meta) -> (streams [T, n, D], cache)`` runs embedding ->
``hc_mult`` streams -> blocks; :meth:`V4Model.logits` applies the HC head, the final norm and the
head. A block is two hyper-connection sites around attention and the MoE. Layers of one kind
(attention type, hash routing) are stacked and scanned (:mod:`jaxdsa.models.layer_groups`). Every
layer writes its cache rows at its model-layer index (``window``) or at its index among the layers
of its kind (the compressed layers' state and entries), see :mod:`.family`.

:meth:`V4Model.draft` runs the MTP block (docs/models.md §3.10; DeepSeek's ``MTPBlock``, HF has none)
on the main model's final streams with its own cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa.cache import Cache, StepMeta
from jaxdsa.layers.linear import Embed, Linear
from jaxdsa.layers.norms import RMSNorm
from jaxdsa.layers.rope import cos_sin
from jaxdsa.layers.segments import segments
from jaxdsa.models.deepseek_v4.attention import Attention
from jaxdsa.models.deepseek_v4.config import V4Config
from jaxdsa.models.deepseek_v4.context import V4Context
from jaxdsa.models.deepseek_v4.hyper import HyperHead, HyperSite, expand, site_out
from jaxdsa.models.deepseek_v4.moe import MoE
from jaxdsa.models.layer_groups import build_groups, take_layer


class Block(nnx.Module):
    """HC site -> RMSNorm -> attention, HC site -> RMSNorm -> MoE, on the streams."""

    def __init__(self, cfg: V4Config, layer: int, *, dtype, rngs: nnx.Rngs):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hc_attn = HyperSite(cfg)
        self.attn_norm = RMSNorm(D, eps, dtype=dtype)
        self.attn = Attention(cfg, cfg.layer_type(layer), cfg.compress_ratio(layer), dtype=dtype, rngs=rngs)
        self.hc_ffn = HyperSite(cfg)
        self.ffn_norm = RMSNorm(D, eps, dtype=dtype)
        self.ffn = MoE(cfg, hashed=cfg.is_hash_layer(layer), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: V4Context, cache: Cache, rows: tuple) -> tuple[jax.Array, Cache]:
        """Streams [T, n, D] -> (streams, cache); ``rows`` as in :meth:`Attention.__call__`."""
        h, post, comb = self.hc_attn(x)
        a, cache = self.attn(self.attn_norm(h), ctx, cache, rows)
        x = site_out(x, a, post, comb)
        h, post, comb = self.hc_ffn(x)
        return site_out(x, self.ffn(self.ffn_norm(h), ctx.tokens, ctx.meta.seq_ids >= 0), post, comb), cache


class MtpBlock(nnx.Module):
    """``X = e_proj(enorm(E[x_{t+1}]))`` on every stream ``+ h_proj(hnorm(X_t))`` (per stream), one
    block, then its own HC head and norm (the head is the main model's)."""

    def __init__(self, cfg: V4Config, *, dtype, rngs: nnx.Rngs):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(D, eps, dtype=dtype)
        self.hnorm = RMSNorm(D, eps, dtype=dtype)
        self.e_proj = Linear((D,), (D,), ("embed", "embed"), dtype=dtype, rngs=rngs)
        self.h_proj = Linear((D,), (D,), ("embed", "embed"), dtype=dtype, rngs=rngs)
        self.block = Block(cfg, cfg.num_hidden_layers, dtype=dtype, rngs=rngs)
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(D, eps, dtype=dtype)


def kind_rows(kinds: list[str]) -> tuple[int, ...]:
    """Each layer's row among the layers of its attention kind (the kind's cache entries)."""
    return tuple(kinds[:i].count(kind) for i, kind in enumerate(kinds))


class V4Model(nnx.Module):
    """Embedding, scanned blocks, HC head, final norm, head and (optionally) the MTP block.

    ``scan_layers=False``: one module per layer, run unrolled (compile time grows with depth).
    """

    def __init__(self, cfg: V4Config, *, dtype, rngs: nnx.Rngs, mtp: int = 0, scan_layers: bool = True):
        D = cfg.hidden_size
        make_layer = lambda layer, rngs: Block(cfg, layer, dtype=dtype, rngs=rngs)  # noqa: E731
        kinds = [(cfg.layer_type(i), cfg.is_hash_layer(i)) for i in range(cfg.num_hidden_layers)]
        self.embed = Embed(cfg.vocab_size, D, dtype=dtype, rngs=rngs)
        self.groups = build_groups(kinds, make_layer, rngs, scan=scan_layers)
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.head = Linear(
            (D,), (cfg.vocab_size,), ("embed", "vocab"), dtype=dtype, out_dtype=jnp.float32, rngs=rngs
        )
        self.mtp = nnx.List([MtpBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(mtp)])
        self.cfg = cfg.architecture()  # static in the graph: checkpoints of one architecture share compiles
        self.kind_rows = kind_rows([kind for kind, _ in kinds])

    def context(self, tokens, positions, meta: StepMeta) -> V4Context:
        cfg = self.cfg
        main = cos_sin(positions, cfg.rope, cfg.qk_rope_head_dim)
        compress = cos_sin(positions, cfg.compress_rope, cfg.qk_rope_head_dim)
        return V4Context(tokens, positions, meta, main, compress, *segments(positions, meta))

    def __call__(self, tokens, positions, cache: Cache, meta: StepMeta) -> tuple[jax.Array, Cache]:
        """Run every block -> (the final streams [T, n, D] of every token, the new cache)."""
        ctx = self.context(tokens, positions, meta)
        rows = jnp.asarray(self.kind_rows, jnp.int32)

        def run_layer(layer, carry, i):
            x, cache = carry
            return layer(x, ctx, cache, (i, rows[i]))

        carry = (expand(self.embed(tokens), self.cfg.hc_mult), cache)
        for group in self.groups:
            carry = group(carry, run_layer)
        return carry

    def logits(
        self, x: jax.Array, hc_head: HyperHead | None = None, norm: RMSNorm | None = None
    ) -> jax.Array:
        """Float32 logits [R, vocab] of final streams [R, n, D] (the MTP block passes its own head)."""
        y = (hc_head or self.hc_head)(x)
        return self.head((norm or self.norm)(y))

    def draft(
        self, streams, next_tokens, positions, cache: Cache, meta: StepMeta, *, layer: int = 0
    ) -> tuple[jax.Array, jax.Array, Cache]:
        """The MTP block: logits [R, V] for token t + 2 from the main model's final streams at t (or,
        drafting further, the block's own output there) and token t + 1, and the block's output streams
        [R, n, D], both at ``meta.logits_indices``; ``cache`` is the MTP block's own."""
        mtp = self.mtp[layer]
        ctx = self.context(next_tokens, positions, meta)
        e = mtp.e_proj(mtp.enorm(self.embed(next_tokens)))
        x = e[:, None, :] + mtp.h_proj(mtp.hnorm(streams.astype(e.dtype)))
        x, cache = mtp.block(x, ctx, cache, (layer, layer))
        x = x[meta.logits_indices]
        return self.logits(x, mtp.hc_head, mtp.norm), x, cache

    def layer(self, i: int) -> Block:
        """Block ``i`` as a module of its own (taken out of its stack): a notebook can read it, call
        it, or replace its submodules, and the model runs with the change."""
        if not 0 <= i < self.cfg.num_hidden_layers:
            raise IndexError(f"layer {i} out of range (the model has {self.cfg.num_hidden_layers})")
        self.groups, layer = take_layer(self.groups, i)
        return layer
