"""Cache pages: a free list, reference counts and a prefix cache of full pages (plain Python).

Prefix caching: once a page is full of computed tokens it is registered under a key made of the
key of the page before it and its own tokens, so a key names an exact token prefix (block ids are
never reused, so keys cannot collide). A new request whose tokens start the same way takes those
pages (their reference counts go up) instead of recomputing them. Pages stay cached after their
last request lets go; they are handed out again, least recently used first, only when the free
list is empty. Shared pages are never written: a request only writes tokens it computes, and
those lie beyond its cached prefix.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

BlockKey = tuple[
    int, tuple[int, ...]
]  # (block id of the page before, or -1 for the first; the page's tokens)


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages
        self._blocks: dict[BlockKey, tuple[int, int]] = {}  # key -> (block id, page)
        self._key_of: dict[int, BlockKey] = {}  # page -> its key, for cached pages
        self._evictable: collections.OrderedDict[int, None] = (
            collections.OrderedDict()
        )  # cached, unreferenced; LRU first
        self._next_block_id = 0

    @property
    def num_free(self) -> int:
        """Pages that can be handed out: free, or cached without a request holding them."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages held by requests."""
        return self.num_pages - self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) if fewer can be had."""
        if n > self.num_free:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._blocks[self._key_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    # -- prefix cache -----------------------------------------------------------------------------
    def cached_prefix(self, tokens: Sequence[int], page_size: int, max_pages: int) -> list[tuple[int, int]]:
        """(block id, page) of the longest cached run of ``tokens``' first ``max_pages`` full pages;
        takes nothing."""
        hits: list[tuple[int, int]] = []
        for i in range(max_pages):
            hit = self._blocks.get(
                (hits[-1][0] if hits else -1, tuple(tokens[i * page_size : (i + 1) * page_size]))
            )
            if hit is None:
                break
            hits.append(hit)
        return hits

    def can_take(self, n: int, *, shared: Sequence[int] = ()) -> bool:
        """Whether ``n`` new pages can be allocated once the cached ``shared`` pages are taken
        (an unreferenced cached page counts as free until it is shared)."""
        return n <= self.num_free - sum(self._refs[page] == 0 for page in shared)

    def share(self, pages: Sequence[int]) -> None:
        """A request takes these cached pages (from :meth:`cached_prefix`)."""
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1

    def register(self, parent: int, tokens: Sequence[int], page: int) -> int:
        """Cache a full, computed page holding ``tokens`` after the block ``parent`` (-1: the first
        page); returns its block id (an earlier page's when the same prefix is already cached, and
        then this page stays uncached)."""
        key = (parent, tuple(tokens))
        hit = self._blocks.get(key)
        if hit is not None:
            return hit[0]
        block_id, self._next_block_id = self._next_block_id, self._next_block_id + 1
        self._blocks[key] = (block_id, page)
        self._key_of[page] = key
        return block_id
