"""The paged latent + indexer-key cache and the per-step metadata that addresses it.

Per attention layer the cache holds latent rows ``[num_pages, page_size, kv_lora + rope]``
(normed latent | roped shared key) and, for layers that run an indexer, index keys
``[num_pages, page_size, index_head_dim]``. A sequence owns a list of pages (its page-table
row); its token at position t lives in flat slot ``page_table[t // page_size] * page_size +
t % page_size``. Kernels see only flat slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdsa.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    latent: tuple[jax.Array, ...]
    index_keys: tuple[jax.Array | None, ...]  # None where the layer reuses another's top-k

    @property
    def num_pages(self) -> int:
        return self.latent[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.latent[0].shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepMeta:
    """Addressing for one step over a packed batch of T tokens from B sequences.

    seq_ids [T] int32: the sequence (page-table row) of each token, -1 for padding.
    page_table [B, M] int32: page ids of each sequence (entries past its length are ignored).
    logits_indices [R] int32: tokens whose logits (and final hidden states) the step returns.
    """

    seq_ids: jax.Array
    page_table: jax.Array
    logits_indices: jax.Array


def init_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16, *, mtp: bool = False, sharding=None
) -> KVCache:
    """A zeroed cache for the main layers, or (``mtp=True``) for the next-n prediction layers.

    With ``sharding`` (e.g. pages split over dp) the zeros are made in place on every device.
    """
    layers = (
        range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
        if mtp
        else range(cfg.num_hidden_layers)
    )

    def make() -> KVCache:
        latent = tuple(jnp.zeros((num_pages, page_size, cfg.latent_dim), dtype) for _ in layers)
        index = tuple(
            jnp.zeros((num_pages, page_size, cfg.index_head_dim), dtype) if cfg.has_indexer(i) else None
            for i in layers
        )
        return KVCache(latent=latent, index_keys=index)

    return make() if sharding is None else jax.jit(make, out_shardings=sharding)()


def cache_bytes_per_token(cfg: ModelConfig, dtype=jnp.bfloat16) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    return itemsize * (cfg.num_hidden_layers * cfg.latent_dim + len(cfg.indexer_layers) * cfg.index_head_dim)


def slots_for(page_table: jax.Array, seq_ids: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat cache slot of (sequence, position) pairs; -1 where the sequence or position is < 0.

    ``positions`` broadcasts against ``seq_ids`` ([T] or [T, K] with seq_ids[:, None]).
    """
    valid = (seq_ids >= 0) & (positions >= 0)
    seq = jnp.where(seq_ids >= 0, seq_ids, 0)
    pos = jnp.where(valid, positions, 0)
    page = page_table[seq, pos // page_size]
    return jnp.where(valid, page * page_size + pos % page_size, -1)


def write_rows(pages: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """Scatter ``rows [T, d]`` into ``pages [P, page, d]`` at flat ``slots`` (-1 dropped)."""
    P, page, d = pages.shape
    flat = pages.reshape(P * page, d)
    flat = flat.at[jnp.where(slots >= 0, slots, P * page)].set(rows.astype(pages.dtype), mode="drop")
    return flat.reshape(P, page, d)
