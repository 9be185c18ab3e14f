"""The timing loop every benchmark shares, JAX's and torch's alike (no JAX or torch imports here).

A replay enqueues several calls back to back and waits once, on the last, so the host's dispatch
of one call overlaps the device work of the one before (as in a serving loop). :mod:`benchmarks.harness`
times jitted JAX ops with it (``harness.time_op``) and :mod:`benchmarks.peers` their torch peers
(CUDA-graph replays); both import it from here, so neither imports the other to time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

REPLAY_S = 0.02  # a replay enqueues calls until it lasts about this long
MAX_CALLS = 8  # calls in flight hold their outputs: 8 x 1 GiB at the copy ceiling


def median_seconds(run: Callable[[], Any], per_call: int, replays: int, wait: Callable[[Any], Any]) -> float:
    """Median over ``replays`` of the wall time per op: each replay enqueues ``calls`` runs of
    ``run()`` back to back and blocks on the last (``wait(result)``; one stream runs them in
    order), divided by ``calls * per_call``. ``calls`` is sized from one synchronous run so a
    replay lasts about ``REPLAY_S``; the one unhidden dispatch then costs at most a few percent."""
    t0 = time.perf_counter()
    wait(run())
    calls = max(1, min(MAX_CALLS, round(REPLAY_S / (time.perf_counter() - t0))))
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        for _ in range(calls - 1):
            run()
        wait(run())
        times.append((time.perf_counter() - t0) / (calls * per_call))
    return statistics.median(times)
