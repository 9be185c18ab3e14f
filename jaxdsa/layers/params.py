"""Creating NNX parameters with their logical axes, initialised for standalone use.

A model built by :class:`jaxdsa.LLM` is built abstractly and filled from a checkpoint (or with
dummy weights), so these initialisers only matter to a module made directly in a notebook:
linear weights ~ N(0, 1/fan_in), norm weights 1, biases 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa.sharding import Axes, check_axes


def param(value: jax.Array, axes: Axes) -> nnx.Param:
    """An ``nnx.Param`` carrying its logical axis names (one per dimension)."""
    check_axes(axes, f"parameter of shape {tuple(value.shape)}")
    if len(axes) != value.ndim:
        raise ValueError(f"parameter of shape {tuple(value.shape)} has {len(axes)} logical axes {axes}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype, axes: Axes) -> nnx.Param:
    return param((jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5).astype(dtype), axes)


def ones(shape: tuple[int, ...], dtype, axes: Axes) -> nnx.Param:
    return param(jnp.ones(shape, dtype), axes)


def zeros(shape: tuple[int, ...], dtype, axes: Axes) -> nnx.Param:
    return param(jnp.zeros(shape, dtype), axes)


def axes_of(variable: nnx.Variable) -> Axes:
    """The logical axes a parameter was declared with (flax < 0.12.4 called the key sharding_names)."""
    meta = variable.get_metadata()
    return meta.get("out_sharding") or meta.get("sharding_names")


def fan_in(shape: tuple[int, ...], in_ndim: int) -> int:
    return math.prod(shape[:in_ndim])
