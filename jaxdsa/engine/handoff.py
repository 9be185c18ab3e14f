"""A request's cache after its prompt, moved between engines (prefill-decode disaggregation).

A prefill engine runs a request's prompt and samples its first token; a decode engine goes on from
there. What passes between them is a :class:`CacheImage`: the rows every cache entry holds for the
request (the main cache and, with MTP, the next-n layers' cache), as one flat byte buffer, plus
the first token. Paged entries move the pages that hold the prompt's positions; a ring entry (a
per-sequence window or state, DeepSeek-V4) moves the request's whole ring. The image is the
entries' logical content, gathered from and scattered into whatever mesh each engine runs: two
engines with different tensor or data parallelism exchange the same bytes, and each side's dp
group keeps its own page and slot numbers.

Nothing is recomputed on the decode side: the image holds the rows of every prompt position and
the first token goes on as the request's first output, so the decode engine continues exactly
where a co-located engine would (its next step runs that token). :class:`ImageLayout` names what
the image holds entry by entry; two engines whose layouts differ (another model, KV dtype, page
size or speculative config) refuse the image rather than misread it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy for np.dtype(name))
import numpy as np

from jaxdsa.cache import Cache, CacheSpec
from jaxdsa.engine.request import TokenLogprobs


@dataclasses.dataclass(frozen=True)
class EntryImage:
    """One cache entry's part of an image: ``cache`` 0 is the main cache, 1 the next-n layers';
    ``shape`` [L, pages, rows, width] for a paged entry, [L, ring rows, width] for a ring."""

    cache: int
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    @property
    def ring(self) -> bool:
        return len(self.shape) == 3


@dataclasses.dataclass(frozen=True)
class ImageLayout:
    """What an image of a request with ``num_tokens`` computed tokens holds, entry by entry."""

    num_tokens: int
    page_size: int
    entries: tuple[EntryImage, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def num_pages(self) -> int:
        return -(-self.num_tokens // self.page_size)

    def to_json(self) -> dict:
        return {
            "num_tokens": self.num_tokens,
            "page_size": self.page_size,
            "entries": [[e.cache, e.name, list(e.shape), e.dtype] for e in self.entries],
        }

    @classmethod
    def from_json(cls, d: dict) -> ImageLayout:
        try:
            entries = tuple(
                EntryImage(int(c), str(n), tuple(int(x) for x in s), str(t)) for c, n, s, t in d["entries"]
            )
            return cls(int(d["num_tokens"]), int(d["page_size"]), entries)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"a cache image layout that does not parse: {error}") from None


@dataclasses.dataclass(frozen=True)
class CacheImage:
    """A request's cache rows after ``layout.num_tokens`` prompt tokens, and the token it sampled."""

    layout: ImageLayout
    first_token: int
    data: np.ndarray  # uint8 [layout.nbytes]: the entries' rows in layout order, each C-contiguous
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked for them


class ImageSource(Protocol):
    """Where a handed-over request's image comes from: a transfer the decode engine starts once it
    holds pages for the request and polls from its steps, or an image already at hand."""

    layout: ImageLayout  # what the prefill side says the image holds
    first_token: int

    def start(self) -> None: ...

    def poll(self) -> CacheImage | None:
        """The image once it has arrived, else None; raises if it never will."""

    def cancel(self) -> None: ...


@dataclasses.dataclass
class ImageAtHand:
    """An :class:`ImageSource` for an image already in this process (two engines of one process)."""

    image: CacheImage

    @property
    def layout(self) -> ImageLayout:
        return self.image.layout

    @property
    def first_token(self) -> int:
        return self.image.first_token

    def start(self) -> None:
        pass

    def poll(self) -> CacheImage:
        return self.image

    def cancel(self) -> None:
        pass


class CacheMover:
    """Gathers a request's rows out of an engine's caches into a :class:`CacheImage` and scatters an
    image into the pages and slot another request holds (compiled once per power-of-two page count,
    :func:`page_bucket`; the caches keep their shardings, the scatter updates them in place)."""

    def __init__(self, specs: tuple[CacheSpec, ...], page_size: int):
        self.page_size = page_size
        self._rings = tuple(frozenset(n for n, e in spec.entries.items() if e.ring) for spec in specs)
        self._scatter = None  # compiled for the caches' shardings at the first load
        self._warmed: dict[tuple, jax.stages.Compiled] = {}  # ("gather" | "scatter", keys, page count)

    def layout(self, caches: list[Cache], num_tokens: int) -> ImageLayout:
        """The layout this engine gives a request of ``num_tokens`` computed tokens."""
        pages = -(-num_tokens // self.page_size)
        entries = []
        for c, cache in enumerate(caches):
            for name in sorted(cache):
                L, _, rows, width = cache[name].shape
                shape = (L, rows, width) if name in self._rings[c] else (L, pages, rows, width)
                entries.append(EntryImage(c, name, shape, np.dtype(cache[name].dtype).name))
        return ImageLayout(num_tokens, self.page_size, tuple(entries))

    def export(
        self,
        caches: list[Cache],
        pages: list[int],
        slot: int,
        num_tokens: int,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
    ) -> CacheImage:
        """The image of a request whose first ``num_tokens`` positions sit in ``pages`` (global page
        numbers, in order) and whose rings sit in row ``slot``."""
        layout = self.layout(caches, num_tokens)
        keys = tuple((e.cache, e.name, e.ring) for e in layout.entries)
        n = layout.num_pages
        bucket = page_bucket(n)
        gather = self._warmed.get(("gather", keys, bucket)) or functools.partial(_gather, keys=keys)
        parts = gather(caches, _padded(pages[:n], bucket), np.int32(slot))
        arrays = [np.asarray(a) if ring else np.asarray(a)[:, :n] for a, (_, _, ring) in zip(parts, keys)]
        data = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])
        return CacheImage(layout, int(first_token), data, first_logprobs)

    def load(self, caches: list[Cache], image: CacheImage, pages: list[int], slot: int) -> list[Cache]:
        """``caches`` with ``image`` written into ``pages`` (global numbers; its first
        ``image.layout.num_pages``) and ring row ``slot``; the caches given are donated."""
        check_layout(self.layout(caches, image.layout.num_tokens), image.layout)
        if image.data.nbytes != image.layout.nbytes:
            raise ValueError(
                f"a cache image of {image.data.nbytes} bytes, its layout says {image.layout.nbytes}"
            )
        n = image.layout.num_pages
        bucket = page_bucket(n)
        parts, offset = [], 0
        for e in image.layout.entries:
            part = image.data[offset : offset + e.nbytes].view(np.dtype(e.dtype)).reshape(e.shape)
            if not e.ring and bucket > n:  # the last page again: its rows are written twice, alike
                part = np.concatenate([part, np.repeat(part[:, -1:], bucket - n, axis=1)], axis=1)
            parts.append(part)
            offset += e.nbytes
        keys = tuple((e.cache, e.name, e.ring) for e in image.layout.entries)
        return self._load(caches, tuple(parts), _padded(pages[:n], bucket), slot, keys)

    def warmup(self, caches: list[Cache], max_tokens: int, export: bool, load: bool) -> None:
        """Compile the gather (``export``) and the scatter (``load``) for every page bucket a request of
        up to ``max_tokens`` tokens uses, so that no request's handoff stalls the engine on a compile.
        Lowered from the caches' shapes and shardings: nothing runs, so a long max_model_len's image
        takes no memory until a request of that length comes."""
        keys = tuple((e.cache, e.name, e.ring) for e in self.layout(caches, 1).entries)  # as export's
        top, bucket = page_bucket(-(-max_tokens // self.page_size)), 1
        slot = np.int32(0)
        while bucket <= top:
            pages = jax.ShapeDtypeStruct((bucket,), np.int32)
            if export:
                self._warmed["gather", keys, bucket] = _gather.lower(caches, pages, slot, keys=keys).compile()
            if load:
                parts = _gather.eval_shape(caches, pages, slot, keys=keys)
                lowered = self._scatter_fn(caches).lower(caches, parts, pages, slot, keys=keys)
                self._warmed["scatter", keys, bucket] = lowered.compile()
            bucket *= 2

    def _load(self, caches, parts, targets, slot, keys) -> list[Cache]:
        scatter = self._warmed.get(("scatter", keys, len(targets)))
        if scatter is not None:
            return scatter(caches, parts, targets, np.int32(slot))
        return self._scatter_fn(caches)(caches, parts, targets, np.int32(slot), keys=keys)

    def _scatter_fn(self, caches: list[Cache]):
        if self._scatter is None:
            shardings = jax.tree.map(lambda a: a.sharding, caches)
            self._scatter = jax.jit(
                _scatter, static_argnames=("keys",), donate_argnums=(0,), out_shardings=shardings
            )
        return self._scatter


def page_bucket(num_pages: int) -> int:
    """The page count a gather or scatter of ``num_pages`` pages runs at: the next power of two, so an
    engine compiles a handful of shapes, not one per prompt length (a compile stalls the engine's
    loop, and with it every running stream)."""
    return 1 << (num_pages - 1).bit_length()


def _padded(pages: list[int], bucket: int) -> np.ndarray:
    """``pages`` with the last one repeated up to ``bucket`` entries."""
    return np.asarray(list(pages) + [pages[-1]] * (bucket - len(pages)), np.int32)


@functools.partial(jax.jit, static_argnames=("keys",))
def _gather(caches, pages, slot, *, keys):
    return tuple(caches[c][name][:, slot] if ring else caches[c][name][:, pages] for c, name, ring in keys)


def _scatter(caches, parts, pages, slot, *, keys):
    caches = [dict(cache) for cache in caches]
    for (c, name, ring), part in zip(keys, parts):
        index = (slice(None), slot) if ring else (slice(None), pages)
        caches[c][name] = caches[c][name].at[index].set(part)
    return caches


def check_layout(mine: ImageLayout, theirs: ImageLayout) -> None:
    """Raise ValueError naming the first difference between two engines' layouts for one request."""
    if (mine.num_tokens, mine.page_size) != (theirs.num_tokens, theirs.page_size):
        raise ValueError(
            f"the prefill side's image holds {theirs.num_tokens} tokens in pages of {theirs.page_size}, "
            f"this server expects {mine.num_tokens} in pages of {mine.page_size}"
        )
    a = {(e.cache, e.name): e for e in mine.entries}
    b = {(e.cache, e.name): e for e in theirs.entries}
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            cache = "the next-n (MTP) layers' cache" if key[0] else "the cache"
            raise ValueError(
                f"the prefill and decode servers' caches differ in {cache}'s entry {key[1]!r}: "
                f"prefill {b.get(key)}, decode {a.get(key)} (same model, --kv-cache-dtype, page size "
                f"and --speculative-config on both sides)"
            )
