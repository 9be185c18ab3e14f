"""Progress of long start-up work (weights loaded, step shapes compiled): a bar on a terminal, a line
per item in a log.

A ``\\r``-rewritten line is unreadable once stderr goes to a file (a service's journal, ``nohup``):
one long line of every update. So on a terminal the progress is a tqdm bar, and anywhere else each
finished item is one line with what it was and the time so far.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import tqdm


class Progress:
    """``total`` items of ``what`` (e.g. "compiling step shapes"); :meth:`done` after each one.

    ``enabled=False`` prints nothing; ``stream`` defaults to stderr and decides the form (bar on a
    TTY, lines otherwise)."""

    def __init__(self, what: str, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.what, self.total, self.count = what, total, 0
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and total > 0
        self.start = time.perf_counter()
        self.bar = None
        if self.enabled and _is_tty(self.stream):
            self.bar = tqdm.tqdm(total=total, desc=f"jaxdsa: {what}", file=self.stream, leave=True)

    def done(self, item: str = "") -> None:
        """One more item finished; ``item`` names it (a log line carries it, a bar shows it last)."""
        self.count += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(item, refresh=False)
            self.bar.update(1)
            if self.count == self.total:
                self.bar.close()
            return
        elapsed = time.perf_counter() - self.start
        detail = f" {item}" if item else ""
        print(
            f"jaxdsa: {self.what}: {self.count}/{self.total}{detail} ({elapsed:.1f} s)",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        """Ends the bar early (an error part way); lines need nothing."""
        if self.bar is not None and not self.bar.disable:
            self.bar.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False
