"""``layers.linear.project``: projections of one input, grouped into one kernel launch when their
weights are quantized alike, each result equal to the linear's own call (CPU, interpret kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdsa.layers.linear import Linear, project
from pallas_kernels.quant import layout


def _int4(rng, k: int, n: int):
    q = rng.integers(-8, 8, size=(n, k))
    scale = (rng.uniform(0.5, 1.5, size=(n, k // 32)) / (8 * np.sqrt(k))).astype(np.float32)
    return jax.tree.map(jnp.asarray, layout.pack_int4(q, scale, group_size=32))


def _linears(n_outs, quantized: bool):
    rngs = nnx.Rngs(0)
    linears = [Linear((128,), (n,), ("embed", "q_lora"), dtype=jnp.float32, rngs=rngs) for n in n_outs]
    if quantized:
        rng = np.random.default_rng(0)
        for linear, n in zip(linears, n_outs):
            linear.weight.set_value(_int4(rng, 128, n))
    return linears


def _calls(fn, *args) -> list[str]:
    """Names of the pallas_calls in ``fn``'s jaxpr, nested ones included."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn.params["name"]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("quantized", [False, True])
def test_project_equals_each_linear(interpret, quantized):
    linears = _linears((64, 48), quantized)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 128)), jnp.float32)
    got = project(x, linears)
    for y, linear in zip(got, linears):
        np.testing.assert_allclose(y, linear(x), rtol=1e-5, atol=1e-6)
    launches = _calls(lambda x: project(x, linears), x)
    assert launches == (["quant_matmul"] if quantized else [])  # two quantized weights, one launch


def test_mixed_weights_are_each_their_own_call(interpret):
    """A dense weight beside a quantized one: no grouping, the quantized one its own launch."""
    dense, quantized = _linears((64,), False)[0], _linears((48,), True)[0]
    x = jnp.ones((2, 128), jnp.float32)
    got = project(x, [dense, quantized])
    np.testing.assert_allclose(got[0], dense(x), rtol=1e-6)
    np.testing.assert_allclose(got[1], quantized(x), rtol=1e-6)
    assert _calls(lambda x: project(x, [dense, quantized]), x) == ["quant_matmul"]
