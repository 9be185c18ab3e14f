"""A scanned layer's view of a weight its kernels read from the whole stack.

Scanned layers keep their parameters stacked on a leading ``layers`` axis and run under
``lax.scan`` (:mod:`jaxdsa.models.layer_groups`). A parameter scanned as an ``xs`` reaches the layer
as its per-layer slice; that is free for XLA's own ops, which read through the slice, but a Pallas
kernel is a custom call whose operands XLA must materialize, so it would copy the layer's weights
out of the stack every step (one GLM-5 MoE layer's INT4 experts: ~4.8 GB). The weights a module's
kernels read are therefore handed to it whole, as a :class:`LayerSlice` (the stack and the traced
layer index), and the module passes both to the op (``layer=``), whose kernel indexes the stack in
place. A module declares which of its variables it reads this way with a ``stack_reads()`` method.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from jaxdsa.quantized_weight import take_layer


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stack", "index"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Layer ``index`` (int32 scalar, traced) of ``stack`` (an array or a ``QuantizedWeight`` with a
    leading layers dim), not sliced yet."""

    stack: Any
    index: jax.Array

    def take(self) -> Any:
        """The layer's own value (a dynamic slice: what the scan would have handed the layer)."""
        return take_layer(self.stack, self.index)


def split_layer(value: Any) -> tuple[Any, jax.Array | None]:
    """``(stack, layer index)`` of a :class:`LayerSlice`; ``(value, None)`` for a plain value (an
    unrolled layer's own weight)."""
    if isinstance(value, LayerSlice):
        return value.stack, value.index
    return value, None


def layer_value(value: Any) -> Any:
    """The layer's own value: a :class:`LayerSlice` sliced, a plain value as it is. For consumers
    that are not kernels, which get the same slice a scanned ``xs`` would give them."""
    return value.take() if isinstance(value, LayerSlice) else value
