"""Multi-host runs through JAX's own runtime.

Call :func:`initialize` in every process before building a ``jaxdsa.LLM``; the mesh then spans
the devices of all processes, each process reads only its devices' weight slices, and every
process runs the same program (SPMD). The coordinator address, process count and id come from
the arguments or from ``JAXDSA_COORDINATOR_ADDRESS`` / ``JAXDSA_NUM_PROCESSES`` /
``JAXDSA_PROCESS_ID`` (or whatever ``jax.distributed`` detects in a cluster).
"""

from __future__ import annotations

import os

import jax


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    env = os.environ.get
    coordinator_address = coordinator_address or env("JAXDSA_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _int(env("JAXDSA_NUM_PROCESSES"))
    process_id = process_id if process_id is not None else _int(env("JAXDSA_PROCESS_ID"))
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )


def _int(value: str | None) -> int | None:
    return None if value is None else int(value)
