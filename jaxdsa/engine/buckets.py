"""Shape buckets: the padded sizes a jitted step compiles for.

Every variable-length input (tokens of a step, pages of a sequence, banned ids of a row) is padded
to the next power of two, so a server compiles O(log n) shapes per step variant and never one per
request. One rule for the whole engine, so warm-up can enumerate exactly the shapes serving meets.
"""

from __future__ import annotations


def bucket(n: int, minimum: int = 1, cap: int | None = None) -> int:
    """The power of two >= max(n, minimum), or ``cap`` when that is smaller (``cap`` >= n)."""
    size = max(minimum, 1 << max(n - 1, 0).bit_length())
    return size if cap is None else min(size, cap)


def buckets(cap: int, minimum: int = 1) -> list[int]:
    """Every size :func:`bucket` returns for n in 1..cap, ascending."""
    sizes, n = [], minimum
    while n < cap:
        sizes.append(n)
        n *= 2
    return sizes + [cap]
