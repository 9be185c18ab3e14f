"""Start-up progress: a line per finished item in a log, a bar on a terminal, nothing when off."""

from __future__ import annotations

import io

from jaxdsa.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_per_item_naming_it():
    log = io.StringIO()
    bar = Progress("compiling step shapes", 3, stream=log)
    for item in ("1 tokens", "2 tokens", "4 tokens"):
        bar.done(item)
    lines = log.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in log.getvalue()
    assert lines[0].startswith("jaxdsa: compiling step shapes: 1/3 1 tokens (")
    assert lines[2].startswith("jaxdsa: compiling step shapes: 3/3 4 tokens (") and lines[2].endswith(" s)")


def test_a_terminal_gets_a_bar_that_ends_complete():
    tty = _Terminal()
    bar = Progress("loading weights", 4, stream=tty)
    for layer in range(4):
        bar.done(f"layer {layer}")
    text = tty.getvalue()
    assert "\r" in text and "jaxdsa: loading weights" in text
    assert "4/4" in text.rsplit("\r", 1)[-1] and bar.count == 4


def test_disabled_or_empty_progress_prints_nothing():
    log = io.StringIO()
    quiet = Progress("loading weights", 2, enabled=False, stream=log)
    quiet.done()
    quiet.done()
    Progress("compiling step shapes", 0, stream=log).close()
    assert log.getvalue() == "" and quiet.count == 2
