"""The paged cache, sized from a family's cache spec, and the per-step metadata that addresses it.

A family declares what one token stores (:class:`CacheSpec`: named entries, each a row of some
width in some number of layers); the cache holds one array per entry, ``[layers, pages,
page_size, width]``, allocated once. A sequence owns a list of pages (its page-table row); its
token at position t lives in flat slot ``page_table[t // page_size] * page_size + t % page_size``
of every layer. Kernels see only flat slots: a layer's rows are the stacked array seen flat with
the layer's offset added (:class:`LayerPages`), so a scanned layer reads and writes its slice of
the carried buffer in place, and the cache layout does not depend on how layers are grouped.

Two variations serve families whose state is not one row per token (DeepSeek-V4):

* an entry with ``ratio`` m holds one row per m tokens, ``page_size // m`` rows per page (row j of a
  sequence: its page ``j // (page_size // m)`` of the same page table), for compressed entries;
* an entry with ``ring`` R holds R rows per *sequence* (``[layers, sequences, R + lookahead,
  width]``, indexed by the page-table row), for what only the last few positions need: position t
  sits in ring row ``t % (R + lookahead)``, so a speculative step's rejected drafts never overwrite
  a row a later step still reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxdsa.sharding import Axes

# The FP8 cache formats' writer and reference decoder, re-exported for the model code.
from pallas_kernels.quant import kv_fp8 as kv_fp8

# [layers, pages, page, width]: pages split over the data-parallel groups
CACHE_AXES: Axes = ("layers", "cache_pages", "page", "cache_width")
# [layers, sequences, ring, width]: a ring entry's sequences split like the pages
RING_AXES: Axes = ("layers", "cache_seqs", "ring", "cache_width")

Cache = dict[str, jax.Array]

# vLLM's --kv-cache-dtype names that jaxdsa serves: the model's dtype, or FP8 in the released engines'
# layouts (docs/models.md §5.8). fp8_e5m2 and the other vLLM choices are not formats these models ship.
FP8_NAMES = ("fp8", "fp8_e4m3", "fp8_ds_mla")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", *FP8_NAMES)


def kv_cache_format(kv_cache_dtype: str, model_dtype) -> str:
    """``'model'`` (rows in the model's dtype) or ``'fp8'`` for a ``--kv-cache-dtype`` value; a
    dtype name that is not the model's is an error (the cache is kept in the model's dtype)."""
    name = (kv_cache_dtype or "auto").strip().lower()
    if name in FP8_NAMES:
        return "fp8"
    if name == "auto" or name == jnp.dtype(model_dtype).name:
        return "model"
    if name in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r}: the cache is kept in the model's dtype "
            f"({jnp.dtype(model_dtype).name}) or in fp8; use auto or fp8"
        )
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One kind of row: ``width`` values in each of ``layers`` layers, stored in ``dtype`` (None: the
    cache's dtype, i.e. the model's; a family pins float32 for state it must keep exact). One row
    per token, per ``ratio`` tokens, or (``ring`` > 0) a ring of that many rows per sequence.
    ``width_axis``: the logical name of the width; a row of per-head state (GLM-5.3-Flash's KDA) is
    laid out head-major and named by its heads, so it splits over TP with them."""

    layers: int
    width: int
    dtype: object = None
    ratio: int = 1
    ring: int = 0
    width_axis: str = "cache_width"

    def device_width(self, shards: Callable[[str], int] | None) -> int:
        """The width one device holds, ``shards`` giving the pieces a logical axis is cut into (None:
        whole, as off a mesh)."""
        return self.width if shards is None else -(-self.width // shards(self.width_axis))

    def rows_per_page(self, page_size: int) -> int:
        if page_size % self.ratio:
            raise ValueError(f"page size {page_size} is not a multiple of a cache entry's ratio {self.ratio}")
        return page_size // self.ratio

    def itemsize(self, dtype) -> int:
        return jnp.dtype(self.dtype or dtype).itemsize


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a family's cache holds (entries by name)."""

    entries: dict[str, CacheEntry]

    def _live(self, ring: bool) -> list[CacheEntry]:
        return [e for e in self.entries.values() if e.layers and bool(e.ring) == ring]

    def page_bytes(self, dtype, page_size: int, shards: Callable[[str], int] | None = None) -> int:
        """Bytes of one page of every paged entry, over every layer (on one device with ``shards``:
        see :meth:`CacheEntry.device_width`)."""
        return sum(
            e.itemsize(dtype) * e.layers * e.device_width(shards) * e.rows_per_page(page_size)
            for e in self._live(False)
        )

    def bytes_per_token(self, dtype, page_size: int, shards: Callable[[str], int] | None = None) -> float:
        return self.page_bytes(dtype, page_size, shards) / page_size

    def sequence_bytes(self, dtype, lookahead: int = 0, shards: Callable[[str], int] | None = None) -> int:
        """Bytes of one sequence's rings and states, over every layer (0 for a family without rings;
        on one device with ``shards``: see :meth:`CacheEntry.device_width`)."""
        return sum(
            e.itemsize(dtype) * e.layers * e.device_width(shards) * (e.ring + lookahead)
            for e in self._live(True)
        )

    def axes(self) -> dict[str, Axes]:
        return {
            name: (*(RING_AXES if e.ring else CACHE_AXES)[:-1], e.width_axis)
            for name, e in self.entries.items()
            if e.layers
        }


def init_cache(
    spec: CacheSpec,
    num_pages: int,
    page_size: int,
    dtype,
    *,
    num_seqs: int = 1,
    lookahead: int = 0,
    sharding=None,
) -> Cache:
    """A zeroed cache: ``num_pages`` pages of every paged entry, rings for ``num_seqs`` sequences
    (page-table rows) with ``lookahead`` spare rows each; with ``sharding`` (a pytree like the cache,
    or one sharding for every entry) the zeros are made in place on every device."""

    def shape(e: CacheEntry) -> tuple[int, ...]:
        if e.ring:
            return (e.layers, num_seqs, e.ring + lookahead, e.width)
        return (e.layers, num_pages, e.rows_per_page(page_size), e.width)

    def make() -> Cache:
        return {name: jnp.zeros(shape(e), e.dtype or dtype) for name, e in spec.entries.items() if e.layers}

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
    """Layer ``layer`` (a traced index inside a scan) of a stacked page array ``[L, P, page, w]``
    (or of a ring ``[L, sequences, rows, w]``: the same flat addressing, a sequence for a page)."""

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
        """Scatter ``rows [T, w]`` into this layer's flat ``slots`` (-1 dropped), in place.

        One row (a single stream's decode step) is written as an update of one slice whose index is
        always in bounds, keeping the old row where the slot is -1: XLA:GPU ran the dropping scatter
        of one row as three kernels (a bounds check, a select, the update), this as at most two."""
        L, P, page, w = self.stacked.shape
        flat = self.stacked.reshape(L * P * page, w)
        rows = rows.astype(flat.dtype)
        if slots.shape == (1,):
            at = jnp.maximum(slots[0], 0) + self._slot_offset()
            kept = lax.dynamic_slice_in_dim(flat, at, 1)
            flat = lax.dynamic_update_slice_in_dim(flat, jnp.where(slots[0] >= 0, rows, kept), at, 0)
        else:
            at = jnp.where(slots >= 0, slots + self._slot_offset(), L * P * page)
            flat = flat.at[at].set(rows, mode="drop")
        return LayerPages(flat.reshape(L, P, page, w), self.layer)

    def rows(self, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every layer's rows seen flat ``[L*P*page, w]`` and ``slots`` moved into this layer (-1 kept)."""
        L, P, page, w = self.stacked.shape
        return self.stacked.reshape(L * P * page, w), jnp.where(slots >= 0, slots + self._slot_offset(), -1)

    def pages(self, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every layer's pages ``[L*P, page, w]`` and ``page_table`` moved into this layer."""
        L, P, page, w = self.stacked.shape
        return self.stacked.reshape(L * P, page, w), page_table + self.layer * P
