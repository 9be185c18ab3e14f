"""1-byte arrays of 2-4 GiB get 64-bit element offsets in the Pallas-Triton lowering
(pallas_kernels._triton: JAX picks 64-bit offsets above 2**32 bytes, but the offsets count
elements and Triton sign-extends 32-bit ones; on the H100 every INT4 MoE row of GLM-5 read wrong
weights). Checked on the Triton IR that the real lowering builds on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels._triton import compiler_params, lower_for_cuda, needs_wide_offsets, pl


def test_which_arrays_need_wide_offsets():
    assert needs_wide_offsets((256, 3072, 4096), 1)  # GLM-5 INT4 / FP4 gate|up codes, 3.2 GB
    assert needs_wide_offsets((256, 2048, 6144), 1)  # GLM-5 FP8 down codes
    assert not needs_wide_offsets((256, 1024, 6144), 1)  # INT4 down codes, 1.6 GB: 32-bit is enough
    assert not needs_wide_offsets((256, 6144, 4096), 2)  # bf16: JAX's own check goes 64-bit
    assert not needs_wide_offsets((256, 2048, 4096), 1)  # exactly 2**31 elements: the last offset fits
    # GLM-5's INT4 gate|up codes stacked over its 78 layers (scanned layers pass whole stacks):
    # past 2**32 bytes, so JAX's own check already goes 64-bit
    assert not needs_wide_offsets((78, 256, 3072, 4096), 1)


def _triton_ir(rows: int, cols: int) -> str:
    """The Triton module of a kernel reading 16 bytes from the last row of a uint8 [rows, cols]."""
    from jax._src.pallas.triton import lowering

    def kernel(x_ref, o_ref):
        start = pl.multiple_of(pl.program_id(0) * 16, 16)
        o_ref[...] = x_ref[rows - 1, pl.ds(start, 16)].astype(jnp.int32)

    def call(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((16,), jnp.int32),
            grid=(1,),
            compiler_params=compiler_params(4, 1),
        )(x)

    texts = []
    build = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = build(*args, **kwargs)
        texts.append(str(result.module))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        lower_for_cuda(call, jax.ShapeDtypeStruct((rows, cols), jnp.uint8))
    finally:
        lowering.lower_jaxpr_to_triton_module = build
    return "\n".join(texts)


def _addptr_lines(text: str) -> list[str]:
    """Address computations into the uint8 input (the int32 output is small either way)."""
    return [line for line in text.splitlines() if "tt.addptr" in line and "ptr<i8>" in line]


@pytest.mark.parametrize("rows,wide", [(5, True), (3, True), (1, False)])
def test_offsets_width_in_the_triton_ir(rows, wide):
    """5 GiB (a layer stack's size): past 2**32 bytes, JAX's own 64-bit offsets; 3 GiB: past 2**31
    elements, widened here; 1 GiB: neither."""
    lines = _addptr_lines(_triton_ir(rows, 2**30))
    assert lines
    assert all(("xi64>" in line) == wide for line in lines), lines
