"""A step's buffers packed into one int32 array on the host and taken apart in the step."""

import jax
import numpy as np
import pytest

from jaxdsa.cache import StepMeta
from jaxdsa.engine.step import StepInputs, pack_inputs, unpack_inputs


def _inputs(rng: np.random.Generator, groups: int, T: int = 6, R: int = 3, K: int = 2) -> StepInputs:
    ints = lambda *shape: rng.integers(-5, 1000, size=shape).astype(np.int32)  # noqa: E731
    floats = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    G = groups
    return StepInputs(
        tokens=ints(G * T),
        positions=ints(G * T),
        from_slot=ints(G * T),
        meta=StepMeta(ints(G * T), ints(G * 4, 5), ints(G * R * K)),
        rows=(floats(G * R), floats(G * R), ints(G * R), ints(G * R), ints(G * R)),
        row_slots=ints(G * R),
        banned=ints(G * R * K, 3),
        penalty_rows=(ints(G * R), floats(G * R), floats(G * R), floats(G * R), rng.random(G * R) < 0.5),
        proposed=ints(G * R, K),
        drafting=(ints(G * T), ints(G * R)),
        scoring=(),
    )


@pytest.mark.parametrize("groups", [1, 3])
def test_each_group_unpacks_its_share_of_every_buffer(groups):
    rng = np.random.default_rng(groups)
    inputs = _inputs(rng, groups)
    packed, layout = pack_inputs(inputs, groups)
    assert packed.dtype == np.int32 and packed.shape[0] == groups
    for g in range(groups):
        got = jax.jit(unpack_inputs, static_argnums=1)(packed[g : g + 1], layout)
        for want, have in zip(jax.tree.leaves(inputs), jax.tree.leaves(got), strict=True):
            share = np.split(want, groups)[g]
            assert have.dtype == share.dtype and have.shape == share.shape
            np.testing.assert_array_equal(np.asarray(have), share)  # float32 bit for bit, NaN-free
    assert jax.tree.structure(got) == jax.tree.structure(inputs)


def test_equal_shapes_share_a_layout_and_other_shapes_do_not():
    rng = np.random.default_rng(0)
    _, a = pack_inputs(_inputs(rng, 2), 2)
    _, b = pack_inputs(_inputs(rng, 2), 2)
    _, c = pack_inputs(_inputs(rng, 2, T=8), 2)
    assert a == b and hash(a) == hash(b) and a != c


def test_a_buffer_it_cannot_pack_is_named():
    inputs = _inputs(np.random.default_rng(0), 2)
    with pytest.raises(TypeError, match="int64"):
        pack_inputs(inputs._replace(tokens=inputs.tokens.astype(np.int64)), 2)
    with pytest.raises(ValueError, match="does not split into 2 groups"):
        pack_inputs(inputs._replace(tokens=inputs.tokens[:-1]), 2)
