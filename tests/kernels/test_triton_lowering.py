"""The CPU lowering helper runs the MLIR verifier on every Triton module it builds.

Pallas serializes its Triton module unverified; only the Triton compiler on a GPU would reject an
invalid one. The known case below is the one that kept top-k's secant search off the GPU: a
``where`` of two integer literals, carried through a ``while`` loop, lowers to ``i1`` where the
loop took ``i32`` in. (Should a JAX release lower it correctly, this case needs another invalid
module.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from pallas_kernels._triton import lower_for_cuda, pl


def _kernel(x_ref, o_ref, *, literal_flag: bool):
    def body(state):
        i, _ = state
        up = x_ref[0] > i.astype(jnp.float32)
        side = jnp.where(up, 1, -1) if literal_flag else 2 * up.astype(jnp.int32) - 1
        return i + 1, side

    i, side = lax.while_loop(lambda s: s[0] < 4, body, (jnp.int32(0), jnp.int32(0)))
    o_ref[0] = (i + side).astype(jnp.float32)


def _lower(literal_flag: bool) -> str:
    call = pl.pallas_call(
        functools.partial(_kernel, literal_flag=literal_flag),
        out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
    )
    return lower_for_cuda(call, jax.ShapeDtypeStruct((16,), jnp.float32))


def test_valid_module_lowers():
    assert "__gpu$xla.gpu.triton" in _lower(literal_flag=False)


def test_invalid_module_fails_on_the_cpu():
    with pytest.raises(Exception, match="scf.while"):
        _lower(literal_flag=True)
