"""Shared Pallas-Triton plumbing: the guarded import, the one deprecation filter, GPU lookup.

The Pallas Triton backend is deprecated upstream (JAX >= 0.11) and warns at every lowering;
this module is the single place that silences that warning. Kernels import ``pl`` and
``pltriton`` from here so a future backend swap touches one file.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import jax
from jax.experimental import pallas as pl  # noqa: F401  (re-exported for kernels)

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

try:
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - only on jax builds without the Triton dialect
    pltriton = None

# Abstract device names that JAX's gpu_info resolves per architecture (pallas-gpu.md §1.4).
LOWERING_TARGETS = {
    "sm_80": "NVIDIA A100",
    "sm_90": "NVIDIA H100",
    "sm_120": "NVIDIA RTX PRO 6000",
}


def compiler_params(num_warps: int, num_stages: int):
    """Explicit Triton compiler params (the same code path on JAX 0.11.2 and 0.12)."""
    if pltriton is None:
        raise RuntimeError("this jaxlib has no Pallas Triton support")
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def compute_capability() -> int:
    """Compute capability of the first GPU as an int (90 for H100); 0 when there is none."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return 0
    cc = getattr(dev, "compute_capability", "0")
    return int(str(cc).replace(".", "")) if cc else 0


@contextlib.contextmanager
def abstract_gpu(kind: str) -> Iterator[None]:
    """Lower for a named GPU without having one: an abstract mesh carrying that device kind."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(kind, 1, "cuda"))
    with use_abstract_mesh(mesh):
        yield


def lower_for_cuda(fn: Callable[..., Any], *shapes: Any, target: str = "sm_90", **static: Any) -> str:
    """Run the real Pallas->Triton lowering on the CPU for ``target``; returns the StableHLO text."""
    with abstract_gpu(LOWERING_TARGETS[target]):
        lowered = jax.jit(lambda *a: fn(*a, **static)).trace(*shapes).lower(lowering_platforms=("cuda",))
    return lowered.as_text()
