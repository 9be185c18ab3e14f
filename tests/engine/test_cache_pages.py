"""A layer's paged cache rows are written in place at their slots, -1 dropped: the one-row update a
single stream's decode step takes and the scatter of several rows give the same cache, and no other
layer's or slot's row changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdsa.cache import LayerPages

L, P, PAGE, W = 3, 4, 8, 5


def _stack(seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (L, P, PAGE, W), jnp.float32)


def _expected(stack: np.ndarray, layer: int, slots, rows: np.ndarray) -> np.ndarray:
    flat = stack.copy().reshape(L, P * PAGE, W)
    for slot, row in zip(slots, rows):
        if slot >= 0:
            flat[layer, slot] = row
    return flat.reshape(stack.shape)


@pytest.mark.parametrize("slots", [[13], [-1], [0], [P * PAGE - 1], [3, -1, 30], [-1, -1]])
@pytest.mark.parametrize("layer", [0, 2])
def test_write_stores_rows_at_their_slots_and_drops_minus_one(slots, layer):
    stack = _stack()
    rows = jax.random.normal(jax.random.key(1), (len(slots), W), jnp.float32)

    @jax.jit
    def write(stack, slots, rows, layer):  # traced layer and slots, as inside the scanned step
        return LayerPages(stack, layer).write(slots, rows).stacked

    got = write(stack, jnp.asarray(slots, jnp.int32), rows, jnp.int32(layer))
    np.testing.assert_array_equal(got, _expected(np.asarray(stack), layer, slots, np.asarray(rows)))


def test_one_row_write_casts_to_the_cache_dtype():
    stack = _stack().astype(jnp.bfloat16)
    row = jnp.full((1, W), 1.0 + 2.0**-12, jnp.float32)  # rounds to 1.0 in bf16
    got = LayerPages(stack, 1).write(jnp.asarray([9], jnp.int32), row).stacked
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[1].reshape(-1, W)[9], np.float32), np.ones(W, np.float32))
