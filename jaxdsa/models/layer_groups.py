"""Scanned layers: runs of identical layers compiled once, whatever the model's depth.

A model's layers are grouped into runs of a repeating block (:func:`group_layers`): GLM-5's 3 dense
+ 75 MoE layers are two groups (a 1-layer block 3 times, a 1-layer block 75 times); GLM-5.2's
shared-indexer pattern is a dense group, a group repeating [shared, shared, shared, full] 18
times and a remainder. Each group's parameters are stacked on a leading ``layers`` axis
(:class:`ScannedLayers`, built with ``nnx.vmap``) and run with ``lax.scan``, so the traced step
holds one copy of each distinct block.

The weights that Pallas kernels read (routed experts, quantized linears: each module's
``stack_reads()``) are not scanned over: the scan body hands them to the layer whole, as
:class:`~jaxdsa.layers.stacks.LayerSlice` s of their loop-invariant stacks, and the kernels read
the layer in place. Scanned as ``xs`` they would reach a kernel (an XLA custom call) as slices
that XLA copies out of the stack every step.

A notebook can take one layer out of its stack (:meth:`ScannedLayers.split_at`) to inspect or
replace its modules; the model then runs that block unrolled (:class:`UnrolledLayers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdsa.checkpoints.spec import Leaf, Spec, Stacked
from jaxdsa.layers.stacks import LayerSlice


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers ``first .. first + period * repeats - 1`` as ``repeats`` copies of a ``period``-layer block."""

    first: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.first + self.period * self.repeats


def group_layers(kinds: Sequence[Hashable], max_period: int = 8) -> list[LayerGroup]:
    """Cover ``kinds`` (one hashable per layer) with repeating blocks, greedily from the front:
    at each position take the period whose repeats cover the most layers (the shortest on ties).
    A block that does not repeat is one layer: a longer one would only unroll more code."""
    groups, i = [], 0
    while i < len(kinds):
        best = LayerGroup(i, 1, 1)
        for period in range(1, min(max_period, len(kinds) - i) + 1):
            block = list(kinds[i : i + period])
            repeats = 1
            while kinds[i + repeats * period : i + (repeats + 1) * period] == block:
                repeats += 1
            if repeats > 1 and period * repeats > best.period * best.repeats:
                best = LayerGroup(i, period, repeats)
        groups.append(best)
        i = best.stop
    return groups


class Block(nnx.Module):
    """The layers of one block, run in order."""

    def __init__(self, layers: list[nnx.Module]):
        self.layers = nnx.List(layers)


class ScannedLayers(nnx.Module):
    """A group whose block parameters are stacked ``[repeats, ...]`` and run under ``lax.scan``.

    ``run_layer(layer, carry, layer_index)`` applies one layer; ``layer_index`` is the traced
    model-layer number (cache rows are addressed by it). The variables of :meth:`whole_paths`
    reach the layer as :class:`LayerSlice` s of their stacks, every other one as its slice.
    """

    def __init__(self, group: LayerGroup, blocks: Block):
        self.group, self.blocks = group, blocks

    @classmethod
    def build(cls, group: LayerGroup, make_layer: Callable[[int, nnx.Rngs], nnx.Module], rngs: nnx.Rngs):
        """Stack ``group.repeats`` blocks of ``make_layer(layer, rngs)`` (vmapped construction)."""

        @nnx.split_rngs(splits=group.repeats)
        @nnx.vmap(
            in_axes=(0,),
            out_axes=0,
            axis_size=group.repeats,
            transform_metadata={nnx.PARTITION_NAME: "layers"},
        )
        def make_blocks(rngs):
            return Block([make_layer(group.first + j, rngs) for j in range(group.period)])

        return cls(group, make_blocks(rngs))

    def whole_paths(self) -> set[tuple]:
        """Paths (in ``self.blocks``) of the variables that modules read as whole stacks: each
        module's ``stack_reads()``, asked of the stacked module (a quantized weight is one whatever
        the layer)."""
        return {
            (*path, name)
            for path, node in nnx.iter_graph(self.blocks)
            if hasattr(node, "stack_reads")
            for name in node.stack_reads()
        }

    def __call__(self, carry, run_layer):
        whole = self.whole_paths()
        graphdef, stacks, state = nnx.split(self.blocks, lambda path, _: path in whole, ...)
        is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        g = self.group

        def body(carry, xs):
            b, block_state = xs
            views = jax.tree.map(
                lambda v: v.replace(LayerSlice(v.get_value(), b)), stacks, is_leaf=is_variable
            )
            block = nnx.merge(graphdef, views, block_state)
            for j, layer in enumerate(block.layers):
                carry = run_layer(layer, carry, g.first + b * g.period + j)
            return carry, None

        carry, _ = jax.lax.scan(body, carry, (jnp.arange(g.repeats, dtype=jnp.int32), state))
        return carry

    def split_at(self, block: int) -> list[nnx.Module]:
        """This group as up to three: the blocks before ``block`` (scanned), block ``block``
        unrolled, the blocks after it (scanned); they share the arrays of this one."""
        g = self.group
        graphdef, state = nnx.split(self.blocks)
        blocks = lambda start, stop: nnx.merge(graphdef, jax.tree.map(lambda a: a[start:stop], state))
        parts: list[nnx.Module] = []
        if block > 0:
            parts.append(ScannedLayers(LayerGroup(g.first, g.period, block), blocks(0, block)))
        one = nnx.merge(graphdef, jax.tree.map(lambda a: a[block], state))
        for _, variable in nnx.iter_graph(one):
            if isinstance(variable, nnx.Variable):
                axes = variable.get_metadata().get("out_sharding")
                if axes and axes[0] == "layers":
                    variable.set_metadata("out_sharding", axes[1:])
        parts.append(UnrolledLayers(list(one.layers), g.first + block * g.period))
        if block + 1 < g.repeats:
            rest = LayerGroup(g.first + (block + 1) * g.period, g.period, g.repeats - block - 1)
            parts.append(ScannedLayers(rest, blocks(block + 1, g.repeats)))
        return parts


class UnrolledLayers(nnx.Module):
    """Consecutive layers held as plain modules (a block taken out of its stack)."""

    def __init__(self, layers: list[nnx.Module], first: int):
        self.layers = nnx.List(layers)
        self.first = first

    def __call__(self, carry, run_layer):
        for j, layer in enumerate(self.layers):
            carry = run_layer(layer, carry, self.first + j)
        return carry


def build_groups(
    kinds: Sequence[Hashable],
    make_layer: Callable[[int, nnx.Rngs], nnx.Module],
    rngs: nnx.Rngs,
    *,
    scan: bool,
) -> nnx.List:
    """A model's layers (one kind per layer): stacked and scanned runs (:func:`group_layers`), or
    with ``scan=False`` one module per layer, run unrolled."""
    if scan:
        return nnx.List([ScannedLayers.build(g, make_layer, rngs) for g in group_layers(kinds)])
    return nnx.List([UnrolledLayers([make_layer(i, rngs) for i in range(len(kinds))], 0)])


def group_specs(
    groups: Sequence[nnx.Module], layer_spec: Callable[[int], dict[tuple, Leaf]]
) -> dict[tuple, Spec]:
    """The parameter spec of a model's ``groups`` (held as ``model.groups``) from the sources of one
    layer (``layer_spec(i)``: paths relative to the layer): a scanned group's parameter lists one
    source per layer it stacks, an unrolled layer's is its own."""
    spec: dict[tuple, Spec] = {}
    for k, group in enumerate(groups):
        if isinstance(group, ScannedLayers):
            g = group.group
            for j in range(g.period):
                layers = tuple(g.first + b * g.period + j for b in range(g.repeats))
                per_layer = [layer_spec(i) for i in layers]
                for path in per_layer[0]:
                    items = tuple(s[path] for s in per_layer)
                    spec[("groups", k, "blocks", "layers", j, *path)] = Stacked(items, layers)
        else:
            for j in range(len(group.layers)):
                for path, leaf in layer_spec(group.first + j).items():
                    spec[("groups", k, "layers", j, *path)] = leaf
    return spec


def take_layer(groups: nnx.List, i: int) -> tuple[nnx.List, nnx.Module]:
    """Layer ``i`` as a module of its own: ``(groups, layer)`` where ``groups`` holds the block of
    layer ``i`` unrolled (its scanned group split around it, sharing arrays), so a notebook can
    read, call or replace the layer's submodules and the model runs with the change."""
    for k, group in enumerate(groups):
        if isinstance(group, UnrolledLayers) and group.first <= i < group.first + len(group.layers):
            return groups, group.layers[i - group.first]
        if isinstance(group, ScannedLayers) and group.group.first <= i < group.group.stop:
            g = group.group
            parts = group.split_at((i - g.first) // g.period)
            return take_layer(nnx.List([*groups[:k], *parts, *groups[k + 1 :]]), i)
    raise IndexError(f"layer {i} out of range")
