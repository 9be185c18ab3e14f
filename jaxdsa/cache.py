"""The paged cache, sized from a family's cache spec, and the per-step metadata that addresses it.

A family declares what one token stores (:class:`CacheSpec`: named entries, each a row of some
width in some number of layers); the cache holds one array per entry, ``[layers, pages,
page_size, width]``, allocated once. A sequence owns a list of pages (its page-table row); its
token at position t lives in flat slot ``page_table[t // page_size] * page_size + t % page_size``
of every layer. Kernels see only flat slots: a layer's rows are the stacked array seen flat with
the layer's offset added (:class:`LayerPages`), so a scanned layer reads and writes its slice of
the carried buffer in place, and the cache layout does not depend on how layers are grouped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdsa.sharding import Axes

# [layers, pages, page, width]: pages split over the data-parallel groups
CACHE_AXES: Axes = ("layers", "cache_pages", "page", "cache_width")

Cache = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One kind of per-token row: ``width`` values in each of ``layers`` layers, stored in ``dtype``
    (None: the cache's dtype, i.e. the model's; a family pins float32 for state it must keep exact)."""

    layers: int
    width: int
    dtype: object = None


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a family's cache holds per token (entries by name)."""

    entries: dict[str, CacheEntry]

    def bytes_per_token(self, dtype) -> int:
        itemsize = lambda e: jnp.dtype(e.dtype or dtype).itemsize  # noqa: E731
        return sum(itemsize(e) * e.layers * e.width for e in self.entries.values() if e.layers)

    def axes(self) -> dict[str, Axes]:
        return {name: CACHE_AXES for name, e in self.entries.items() if e.layers}


def init_cache(spec: CacheSpec, num_pages: int, page_size: int, dtype, *, sharding=None) -> Cache:
    """A zeroed cache; with ``sharding`` (a pytree like the cache, or one sharding for every
    entry) the zeros are made in place on every device."""

    def make() -> Cache:
        return {
            name: jnp.zeros((e.layers, num_pages, page_size, e.width), e.dtype or dtype)
            for name, e in spec.entries.items()
            if e.layers
        }

    if sharding is None:
        return make()
    shardings = sharding if isinstance(sharding, dict) else {name: sharding for name in spec.axes()}
    return jax.jit(make, out_shardings=shardings)()


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


def slots_for(page_table: jax.Array, seq_ids: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat cache slot of (sequence, position) pairs; -1 where the sequence or position is < 0.

    ``positions`` broadcasts against ``seq_ids`` ([T] or [T, K] with seq_ids[:, None]).
    """
    valid = (seq_ids >= 0) & (positions >= 0)
    seq = jnp.where(seq_ids >= 0, seq_ids, 0)
    pos = jnp.where(valid, positions, 0)
    page = page_table[seq, pos // page_size]
    return jnp.where(valid, page * page_size + pos % page_size, -1)


@dataclasses.dataclass
class LayerPages:
    """Layer ``layer`` (a traced index inside a scan) of a stacked page array ``[L, P, page, w]``."""

    stacked: jax.Array
    layer: jax.Array | int

    @property
    def num_pages(self) -> int:
        return self.stacked.shape[1]

    @property
    def page_size(self) -> int:
        return self.stacked.shape[2]

    def _slot_offset(self):
        return self.layer * (self.num_pages * self.page_size)

    def write(self, slots: jax.Array, rows: jax.Array) -> LayerPages:
        """Scatter ``rows [T, w]`` into this layer's flat ``slots`` (-1 dropped), in place."""
        L, P, page, w = self.stacked.shape
        flat = self.stacked.reshape(L * P * page, w)
        at = jnp.where(slots >= 0, slots + self._slot_offset(), L * P * page)
        flat = flat.at[at].set(rows.astype(flat.dtype), mode="drop")
        return LayerPages(flat.reshape(L, P, page, w), self.layer)

    def rows(self, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every layer's rows seen flat ``[L*P*page, w]`` and ``slots`` moved into this layer (-1 kept)."""
        L, P, page, w = self.stacked.shape
        return self.stacked.reshape(L * P * page, w), jnp.where(slots >= 0, slots + self._slot_offset(), -1)

    def pages(self, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every layer's pages ``[L*P, page, w]`` and ``page_table`` moved into this layer."""
        L, P, page, w = self.stacked.shape
        return self.stacked.reshape(L * P, page, w), page_table + self.layer * P
