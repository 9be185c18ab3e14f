"""Shared Pallas-Triton plumbing: the guarded import, the one deprecation filter, GPU lookup,
and the shared-memory budget every tuning table fits its configs into.

The Pallas Triton backend is deprecated upstream (JAX >= 0.11) and warns at every lowering;
this module is the single place that silences that warning. Kernels import ``pl`` and
``pltriton`` from here so a future backend swap touches one file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy  # noqa: F401  (jax.numpy.dtype in _widen_offsets)
from jax.experimental import pallas as pl  # noqa: F401  (re-exported for kernels)

warnings.filterwarnings(
    "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
)

try:
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - only on jax builds without the Triton dialect
    pltriton = None


def needs_wide_offsets(shape: Sequence[int], itemsize: int) -> bool:
    """Whether JAX's Pallas-Triton lowering would address an array with 32-bit element offsets that
    overflow. It picks 64-bit offsets only above 2**32 *bytes*, but the offsets count *elements* and
    Triton sign-extends 32-bit ones, so a 1-byte array of more than 2**31 elements (2-4 GiB: GLM-5's
    INT4 / FP4 gate|up codes [256, 3072, 4096], FP8 down codes [256, 2048, 6144]) reads from wrong
    addresses past element 2**31 (seen on H100, JAX 0.11.2: every INT4 MoE row wrong, rel L2
    0.6-1.1; the same code in 0.12.0.1). Interpret mode never shows it."""
    elements = 1
    for dim in shape:
        elements *= int(dim)
    return elements > 2**31 and elements * itemsize <= 2**32


def _widen_offsets() -> None:
    """Wrap the lowering's offset computation so arrays :func:`needs_wide_offsets` flags get 64-bit
    offsets (their size check is shown a 4-byte dtype; only ``.shape`` and the itemsize are read).
    No-op where JAX's internals moved."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:  # pragma: no cover
        return
    original = getattr(lowering, "_compute_offsets_from_indices", None)
    if original is None or getattr(original, "jaxdsa_wide", False):
        return

    def wide(block_info, *args, **kwargs):
        aval = block_info.full_shape_dtype
        if needs_wide_offsets(aval.shape, jax.numpy.dtype(aval.dtype).itemsize):
            wider = aval.update(dtype=jax.numpy.dtype("float32"))
            block_info = dataclasses.replace(block_info, full_shape_dtype=wider)
        return original(block_info, *args, **kwargs)

    wide.jaxdsa_wide = True
    lowering._compute_offsets_from_indices = wide


_widen_offsets()

# Abstract device names that JAX's Pallas-Triton gpu_info (jax/_src/pallas/triton/gpu_info.py) resolves
# to each target's compute capability.
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


# Opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes: 227 KiB on
# H100/H200/B200, 163 KiB on A100, 99 KiB on the consumer / workstation parts.
SHARED_MEMORY: dict[int, int] = {
    80: 166912,
    86: 101376,
    89: 101376,
    90: 232448,
    100: 232448,
    120: 101376,
    121: 101376,
}


def shared_memory_budget(cc: int) -> int:
    """Bytes of shared memory one program may use on compute capability ``cc``. Unknown parts
    (and the CPU, cc 0) get the smallest listed budget, so their configs compile everywhere."""
    return SHARED_MEMORY.get(cc, min(SHARED_MEMORY.values()))


def shared_memory_bytes(*, stage: int, num_stages: int, resident: int = 0, epilogue: int = 0) -> int:
    """Upper bound of the shared memory Triton allocates for one program of a pipelined dot loop:

        max(resident + num_stages * stage, epilogue)

    ``stage``: bytes of the tiles one loop step loads for its dots (at the operand itemsize);
    ``resident``: loop-invariant dot operands loaded before the loop (they live in shared memory
    for the whole loop, or pass through it once on their way to registers); ``epilogue``: the
    output tile after the loop, at 4 bytes per element.

    Why it bounds what Triton allocates: with ``num_stages = S > 1`` the software pipeliner keeps
    ``S - 1`` copies of each load that feeds a dot (observed on H200: the float32 MoE gate_up kernel
    with ``block_m = 32``, 64x128 tiles and 4 stages requested 245760 = 3 x 81920 bytes); with
    ``S = 1`` the loaded tile passes through shared memory once on its way to the dot. Counting
    ``S`` copies leaves one step's tiles for the layout-conversion scratch inside the loop, which
    Triton allocates per operation (one conversion live at a time) and which in these kernels is
    never larger than one step's tiles. After the loop the pipeline buffers are dead and the
    allocator reuses their space for the epilogue's conversion of the output tile to the store
    layout, hence ``max`` and not a sum (observed on H100: a 128-head sparse-MLA program requested
    exactly 262144 bytes, its ``[128, 512]`` float32 accumulator, while its loop needs far less).
    """
    return max(resident + num_stages * stage, epilogue)


def shrink_to_fit[C](cfg: C, nbytes: Callable[[C], int], budget: int, knobs: Sequence[tuple[str, int]]) -> C:
    """Shrink ``cfg`` until ``nbytes(cfg) <= budget``: for each ``(field, floor)`` in order,
    lower that field (``num_stages`` by one, block sizes by halving) down to ``floor``. Knob order
    is the kernel's preference: what costs least speed goes first."""
    for field, floor in knobs:
        while nbytes(cfg) > budget and getattr(cfg, field) > floor:
            value = getattr(cfg, field)
            cfg = dataclasses.replace(cfg, **{field: value - 1 if field == "num_stages" else value // 2})
    if nbytes(cfg) > budget:
        raise ValueError(
            f"{cfg} needs {nbytes(cfg)} bytes of shared memory, more than the {budget} available"
        )
    return cfg


def fit_block(block: int, dim: int, *, floor: int, what: str, op: str) -> int:
    """The largest power of two <= ``block`` dividing ``dim``, at least ``floor``: a tile side that
    never leaves a partial tile (4-bit weights need whole packed chunks, so their K floor is the
    chunk). ``what`` / ``op`` name the dimension and the kernel in the error when none exists."""
    b = block
    while b > floor and (b > dim or dim % b):
        b //= 2
    if b < floor or dim % b:
        raise ValueError(f"{op} needs {what} = {dim} to be a multiple of {floor}")
    return b


def dot_precision(dtype) -> jax.lax.Precision | None:
    """A kernel dot's precision for operands of ``dtype``: HIGHEST for float32 (the float32 models and
    the golden tests need float32 products, not TF32's 10-bit mantissa), the default otherwise
    (bf16 / fp16 tensor-core products, exact for those inputs)."""
    return jax.lax.Precision.HIGHEST if jax.numpy.dtype(dtype) == jax.numpy.float32 else None


def tile_pad(n: int) -> int:
    """``n`` padded to a tile side: the next power of two (Triton tiles must be powers of two), at
    least 16, the smallest extent ``tl.dot`` accepts (the tensor-core MMA minimum for every dim)."""
    return max(16, pl.next_power_of_2(n))


# Streaming multiprocessors of the parts the tuning tables know, for lowering without the GPU (the
# GPU this process runs on reports its own count: :func:`sm_count`). A100, A40 / RTX 3090, RTX
# 4090, H100 / H200 SXM, B200, RTX Pro 6000 Blackwell, DGX Spark (GB10).
SMS = {80: 108, 86: 84, 89: 128, 90: 132, 100: 148, 120: 188, 121: 48}
_DEFAULT_SMS = 108


def sm_count(cc: int | None = None) -> int:
    """Streaming multiprocessors of the part being compiled for (``cc``, default the current target):
    the local GPU's own count when it is that part (an H100 PCIe has 114, not the SXM's 132), else
    :data:`SMS`. Every tuning rule that sizes a grid to fill the GPU (K splits, head blocks, row
    blocks) asks here, so the rules agree on each part."""
    cc = compute_capability() if cc is None else cc
    try:
        dev = jax.devices("gpu")[0]
    except (RuntimeError, IndexError):  # no GPU backend
        dev = None
    local_cc = int(str(getattr(dev, "compute_capability", "0") or "0").replace(".", "")) if dev else 0
    cores = getattr(dev, "core_count", None) if dev else None
    if local_cc == cc and isinstance(cores, int) and cores > 0:
        return cores
    return SMS.get(cc, _DEFAULT_SMS)


def compute_capability() -> int:
    """Compute capability being compiled for, as an int (90 for H100): the abstract device of a
    deviceless lowering (:func:`abstract_gpu`), else the local GPU; 0 without either (CPU
    interpret runs). Every tuning table is keyed by it."""
    if pltriton is not None:
        try:
            return int(pltriton.get_gpu_info().compute_capability)
        except ValueError:  # no GPU and no abstract one: "Unsupported GPU device kind: cpu"
            pass
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


@contextlib.contextmanager
def verified_triton_modules() -> Iterator[None]:
    """Run the MLIR verifier on every Triton module Pallas builds inside the block.

    The lowering serializes its module unverified; on a GPU the Triton compiler then rejects an
    invalid one ("Failed to parse Triton module"), so a CPU lowering alone would pass a kernel
    that can never run (a ``scf.while`` whose carried value lowered to ``i1`` where it entered as
    ``i32`` did). Relies on JAX internals; where they moved, the block runs unverified.
    """
    try:
        from jax._src.pallas.triton import lowering  # pallas_call_registration calls it through the module
    except ImportError:  # pragma: no cover - JAX reorganised the Triton lowering
        yield
        return
    build = lowering.lower_jaxpr_to_triton_module

    def checked(*args, **kwargs):
        result = build(*args, **kwargs)
        module = getattr(result, "module", None)
        if module is not None:
            module.operation.verify()  # raises with the verifier's diagnostics
        return result

    lowering.lower_jaxpr_to_triton_module = checked
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = build


def lower_for_cuda(fn: Callable[..., Any], *shapes: Any, target: str = "sm_90", **static: Any) -> str:
    """Run the real Pallas->Triton lowering on the CPU for ``target``, with every Triton module
    verified (:func:`verified_triton_modules`); returns the StableHLO text."""
    with abstract_gpu(LOWERING_TARGETS[target]), verified_triton_modules():
        lowered = jax.jit(lambda *a: fn(*a, **static)).trace(*shapes).lower(lowering_platforms=("cuda",))
    return lowered.as_text()
