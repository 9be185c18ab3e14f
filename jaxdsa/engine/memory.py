"""How much of each GPU jaxdsa takes, and how much of that the cache gets (vLLM's
``--gpu-memory-utilization``).

JAX's GPU allocator manages a fixed share of each device, taken when its backend starts
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, 75 % unless set); arrays cannot live outside it. With 104 GiB
of GLM-5.2 INT4 weights per H200 at TP 4, the default share (105 GiB) leaves no room for the cache.
:func:`claim` sets the share from ``gpu_memory_utilization`` before the backend starts, so that one
number says what jaxdsa may take, as in vLLM. Inside the share (the *budget*):

    cache = budget - (weights and engine state already placed) - workspace

``workspace`` stays free for what a step allocates while it runs (activations, kernel scratch,
XLA's temporaries): :func:`workspace_bytes`, a tenth of the budget up to 4 GiB. The planner
(:mod:`jaxdsa.plan`) counts the same budget with the same functions, and :func:`check_fits` refuses,
before any weight is read, a deployment whose weights and one full-length sequence's cache do
not fit.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
from jax._src import xla_bridge

log = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_UTILIZATION = 0.9  # vLLM's default
FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_FRACTION = 0.75  # what JAX's GPU allocator takes when the environment says nothing
MAX_WORKSPACE = 4 * GiB


def check_utilization(utilization: float) -> float:
    if not isinstance(utilization, int | float) or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    return float(utilization)


def _fraction_in_effect() -> float:
    return float(os.environ.get(FRACTION_ENV) or JAX_DEFAULT_FRACTION)


def claim(utilization: float) -> None:
    """Make JAX's allocator manage ``utilization`` of each GPU. Before the backend starts this sets
    XLA_PYTHON_CLIENT_MEM_FRACTION (a different value already in the environment is replaced, with
    a log line); once it has started the share is fixed for the process, and a budget above it is
    capped there (:func:`device_memory`)."""
    utilization = check_utilization(utilization)
    current = os.environ.get(FRACTION_ENV)
    if xla_bridge.backends_are_initialized():
        if abs(_fraction_in_effect() - utilization) > 1e-9:
            log.info(
                "JAX started with %.2f of each device's memory; gpu_memory_utilization %.2f counts "
                "within that (set it before the first JAX call to change the allocator)",
                _fraction_in_effect(),
                utilization,
            )
        return
    if current is not None and abs(float(current) - utilization) > 1e-9:
        log.warning("%s=%s replaced by gpu_memory_utilization %s", FRACTION_ENV, current, repr(utilization))
    os.environ[FRACTION_ENV] = repr(utilization)


def workspace_bytes(budget: float) -> float:
    """Kept free inside the budget for what a step allocates while it runs."""
    return min(MAX_WORKSPACE, 0.1 * budget)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device's memory as the engine counts it (bytes): the device's total, the budget jaxdsa
    may use, and what is in use already (the most over the local devices)."""

    total: float
    budget: float
    in_use: float

    @property
    def free(self) -> float:
        """Budget left for the cache and engine state once the workspace is set aside."""
        return self.budget - self.in_use - workspace_bytes(self.budget)


def device_memory(utilization: float) -> DeviceMemory | None:
    """The local devices' memory under ``utilization``, or None where a device reports no
    allocator limit (the CPU: nothing to size against)."""
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    if not stats or "bytes_limit" not in stats[0]:
        return None
    fraction = _fraction_in_effect()
    limit = min(s["bytes_limit"] for s in stats)
    total = limit / fraction
    return DeviceMemory(
        total=total,
        budget=min(utilization, fraction) * total,
        in_use=max(s.get("bytes_in_use", 0) for s in stats),
    )


def check_fits(
    memory: DeviceMemory | None, *, weight_bytes: float, minimum_cache_bytes: float, what: str
) -> None:
    """ValueError naming the numbers when ``weight_bytes`` plus one full-length sequence's cache
    (``minimum_cache_bytes``) and the workspace do not fit the budget of one device."""
    if memory is None:
        return
    need = memory.in_use + weight_bytes + minimum_cache_bytes + workspace_bytes(memory.budget)
    if need <= memory.budget:
        return
    raise ValueError(
        f"{what} does not fit: per device, weights {weight_bytes / GiB:.2f} GiB + the cache of one "
        f"full-length sequence {minimum_cache_bytes / GiB:.2f} GiB + workspace "
        f"{workspace_bytes(memory.budget) / GiB:.2f} GiB"
        + (f" + {memory.in_use / GiB:.2f} GiB already in use" if memory.in_use else "")
        + f" = {need / GiB:.2f} GiB > budget {memory.budget / GiB:.2f} GiB "
        f"(gpu_memory_utilization {memory.budget / memory.total:.2f} of {memory.total / GiB:.1f} GiB). "
        "Raise --gpu-memory-utilization, spread the weights over more GPUs (--tensor-parallel-size, "
        "--expert-parallel-size), or lower --max-model-len"
    )


def cache_pages(
    memory: DeviceMemory | None,
    *,
    page_bytes: float,
    state_bytes: float,
    per_sequence_pages: int,
    groups: int,
    enough: int,
) -> int:
    """Cache pages over all dp groups: what one device's budget holds once the engine's other
    state (``state_bytes`` per device: rings, penalty rows) is set aside, capped at ``enough``;
    ``enough`` where nothing is known about the memory. ValueError (with the numbers) if a device
    cannot hold one sequence's ``per_sequence_pages``."""
    if memory is None:
        return enough
    per_device = int(max(memory.free - state_bytes, 0) // page_bytes)
    if per_device < per_sequence_pages:
        raise ValueError(
            f"the cache budget holds {per_device} pages per device "
            f"({max(memory.free - state_bytes, 0) / GiB:.2f} GiB free of a {memory.budget / GiB:.2f} GiB "
            f"budget after {memory.in_use / GiB:.2f} GiB in use); one full-length sequence needs "
            f"{per_sequence_pages}: raise --gpu-memory-utilization or lower --max-model-len"
        )
    return min(per_device * groups, enough)
