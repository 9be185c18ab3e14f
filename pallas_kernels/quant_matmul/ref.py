"""Pure-JAX quantized matmul: the weight dequantized by its format's definition, then one dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant.layout import QuantizedWeight, dequantize, take_layer


def quant_matmul(x: jax.Array, w: QuantizedWeight, *, layer: jax.Array | None = None) -> jax.Array:
    """``x [M, K] @ W [K, N] -> [M, N]`` in x's dtype; W dequantized to x's dtype (float32 for float32
    activations: exactly the format's values), products accumulated in float32. ``layer``: W is a
    stack ``[L, K, N]`` and layer ``layer`` of it is multiplied."""
    if layer is not None:
        w = take_layer(w, layer)
    wd = dequantize(w, x.dtype)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, wd, preferred_element_type=jnp.float32, precision=precision).astype(x.dtype)


def quant_matmul_many(
    x: jax.Array, ws: tuple[QuantizedWeight, ...], *, layer: jax.Array | None = None
) -> tuple[jax.Array, ...]:
    """``(x @ W_1, x @ W_2, ...)``, each as :func:`quant_matmul`."""
    return tuple(quant_matmul(x, w, layer=layer) for w in ws)
