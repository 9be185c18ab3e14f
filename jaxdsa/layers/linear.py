"""The one linear layer every projection goes through, and the vocabulary embedding."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa import ops, sharding
from jaxdsa.layers.params import fan_in, normal
from jaxdsa.layers.stacks import layer_value, split_layer
from jaxdsa.quantized_weight import QuantizedWeight, dequantize
from jaxdsa.sharding import Axes, Partial


def matrix_axes(axes: Axes, in_ndim: int) -> tuple[str, str]:
    """The logical names of a ``[*in_shape, *out_shape]`` weight flattened to a ``[K, N]`` matrix
    (how a quantized weight holds it): each side keeps the name of its one split dim, which must
    lead its side so that the flattened split is contiguous (``[heads, head_dim]`` -> ``heads``),
    or its first name when nothing on that side is split."""

    def side(names: Axes) -> str:
        split = [i for i, name in enumerate(names) if sharding.RULES[name]]
        if split and split != [0]:
            raise ValueError(f"logical axes {names} cannot be flattened: only the first dim may be split")
        return names[0]

    return side(axes[:in_ndim]), side(axes[in_ndim:])


class Linear(nnx.Module):
    """``y = x . W`` contracting x's trailing ``in_shape`` dims with W's leading ones.

    ``weight [*in_shape, *out_shape]`` carries ``axes`` (one logical name per dim), so a
    head-split projection (``[q_lora, H, d]``) or a head-merging one (``[H, v, D]``) is one
    layer. ``compute_dtype`` casts both operands first (routers and the indexer's head weights run
    in float32); ``out_dtype`` asks the dot for a wider result (logits).

    A loader may replace ``weight`` by a :class:`QuantizedWeight` holding the same values as a
    ``[K, N]`` matrix (K, N the products of the in and out dims; logical axes
    :attr:`matrix_axes`): the layer then runs :func:`jaxdsa.ops.quant_matmul`. Only layers with
    neither ``compute_dtype`` nor ``out_dtype`` are :attr:`quantizable`: those two ask for more
    precision than the activations carry, which a kernel dequantizing to x's dtype does not give.
    ``quantizable=False`` keeps a layer dense whatever its checkpoint stores (dequantized at load):
    for weights a step uses as an array (:meth:`dense`), not through a matmul.
    Scanned, a quantized weight reaches the layer as a :class:`~jaxdsa.layers.stacks.LayerSlice`
    (:meth:`stack_reads`) and the kernel reads it in the stack.
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        axes: Axes,
        *,
        dtype,
        rngs: nnx.Rngs,
        compute_dtype=None,
        out_dtype=None,
        quantizable: bool = True,
    ):
        shape = (*in_shape, *out_shape)
        self.weight = normal(rngs, shape, fan_in(shape, len(in_shape)), dtype, axes)
        self.in_shape = tuple(in_shape)
        self.out_shape = tuple(out_shape)
        self.compute_dtype = compute_dtype
        self.out_dtype = out_dtype
        self.quantizable = quantizable and compute_dtype is None and out_dtype is None
        self.matrix_axes = matrix_axes(axes, self.in_ndim) if self.quantizable else None

    @property
    def in_ndim(self) -> int:
        return len(self.in_shape)

    def stack_reads(self) -> tuple[str, ...]:
        """The weight when it is quantized: only ``quant_matmul``'s kernel reads it in ``__call__``
        (a dense one goes to XLA's dot, which takes the scan's slice as it is)."""
        return ("weight",) if isinstance(self.weight.get_value(), QuantizedWeight) else ()

    def __call__(self, x: jax.Array) -> jax.Array:
        value = self.weight.get_value()
        stack, layer = split_layer(value)
        if isinstance(stack, QuantizedWeight):
            lead, flat = self._flat(x)
            y = ops.quant_matmul(flat, stack, axes=self.matrix_axes, layer=layer)
            return y.reshape(*lead, *self.out_shape)
        return self._dense_dot(x, self.out_dtype)

    def _flat(self, x: jax.Array) -> tuple[tuple[int, ...], jax.Array]:
        """``x``'s leading (token) dims and ``x`` as the ``[tokens, K]`` rows the matmul op takes."""
        lead = x.shape[: x.ndim - self.in_ndim]
        return lead, x.reshape(math.prod(lead), -1)

    def _dense_dot(self, x: jax.Array, out_dtype) -> jax.Array:
        """XLA's dot with a dense weight (the scan's slice of a stacked one)."""
        w = layer_value(self.weight.get_value())
        if self.compute_dtype is not None:
            x, w = x.astype(self.compute_dtype), w.astype(self.compute_dtype)
        return jnp.tensordot(x, w, axes=self.in_ndim, preferred_element_type=out_dtype)

    def unreduced(self, x: jax.Array) -> Partial:
        """``self(x)`` in float32 before the all-reduce a row-parallel layer (its input dim split over
        TP) ends with: each shard's partial sum, for :func:`jaxdsa.sharding.reduce_partials` to
        add to other sums before one all-reduce. A dense weight is left to XLA's dot, which
        all-reduces it itself (asked for a float32 result: no cast of its own)."""
        stack, layer = split_layer(self.weight.get_value())
        if not isinstance(stack, QuantizedWeight):
            return Partial.whole(self._dense_dot(x, jnp.float32))
        lead, flat = self._flat(x)
        p = ops.quant_matmul(flat, stack, axes=self.matrix_axes, layer=layer, unreduced=True)
        return Partial(p.value.reshape(p.value.shape[0], *lead, *self.out_shape), p.axes)

    def dense(self, dtype) -> jax.Array:
        """The weight ``[*in_shape, *out_shape]`` as an array in ``dtype``, for products no ``[K, N]``
        matmul expresses (the absorbed MLA form multiplies each head by its own slice). A quantized
        weight is dequantized here, in the step: layers used this way are built
        ``quantizable=False`` where their bytes allow (:class:`~jaxdsa.layers.mla.MLAttention`)."""
        w = layer_value(self.weight.get_value())
        if isinstance(w, QuantizedWeight):
            return dequantize(w, dtype).reshape(*self.in_shape, *self.out_shape)
        return w.astype(dtype)


def project(x: jax.Array, linears: Sequence[Linear]) -> list[jax.Array]:
    """``[linear(x) for linear in linears]``, the quantized ones in one kernel launch when they take
    x alike (:func:`jaxdsa.ops.quant_matmul_many`: MLA's ``q_a`` and ``kv_a``, an MLP's gate and up):
    at decode each projection is a few microseconds of kernel latency plus a launch, so two become
    one. Anything else (dense weights, mixed stacking) is each linear's own call."""
    values = [split_layer(linear.weight.get_value()) for linear in linears]
    stacks, layers = zip(*values)
    same_input = (
        len({(linear.in_ndim, linear.matrix_axes and linear.matrix_axes[0]) for linear in linears}) == 1
    )
    quantized = all(isinstance(w, QuantizedWeight) for w in stacks)
    one_layer = all(layer is layers[0] for layer in layers)  # one scan index (or none) for all
    if len(linears) < 2 or not (same_input and quantized and one_layer):
        return [linear(x) for linear in linears]
    lead, flat = linears[0]._flat(x)
    ys = ops.quant_matmul_many(
        flat, stacks, axes=tuple(linear.matrix_axes for linear in linears), layer=layers[0]
    )
    return [y.reshape(*lead, *linear.out_shape) for y, linear in zip(ys, linears)]


class Embed(nnx.Module):
    """Token embedding ``[V, D]``, vocabulary split over TP (looked up shard-locally, one psum)."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = normal(rngs, (vocab, dim), 1, dtype, ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return sharding.embed_lookup(self.weight[...], ids)
