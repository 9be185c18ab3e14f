"""The model-family seam: what a family supplies, and the generic helpers built on it.

A family (``jaxdsa/models/<family>/``, registered by HF ``model_type`` in
:mod:`jaxdsa.models.registry`) supplies config parsing, its Flax NNX module tree, the parameter
spec (checkpoint sources of every parameter), its per-layer cache spec, its step and the
host-side step-mode policy. The engine, :class:`jaxdsa.LLM`, the loader, dummy weights and the
planner go only through this interface (docs/architecture.md says how to add a family).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Protocol

import jax
from flax import nnx

from jaxdsa import sharding
from jaxdsa.cache import Cache, CacheSpec, StepMeta
from jaxdsa.checkpoints.quant import QuantConfig
from jaxdsa.checkpoints.spec import Spec
from jaxdsa.layers.params import axes_of
from jaxdsa.sharding import Axes, Parallelism

Path = tuple[Any, ...]

DEFAULT_PAGE_SIZE = 64  # cache page size in tokens, unless a family needs another


class ModelFamily(Protocol):
    """One architecture family. ``cfg`` is the family's own (frozen, hashable) config type."""

    model_types: tuple[str, ...]

    def parse_config(self, raw: Mapping[str, Any], source: str) -> Any:
        """config.json dict -> the family's config; ConfigError (file, field) on anything wrong."""

    def quantization(self, cfg) -> QuantConfig | None:
        """The checkpoint's weight format (None: plain floats)."""

    def build(
        self, cfg, *, dtype, rngs: nnx.Rngs, parallelism: Parallelism | None, mtp: int, scan_layers: bool
    ) -> nnx.Module:
        """The module tree (heads padded for ``parallelism``'s shards); ``mtp`` next-n layers;
        ``scan_layers``: layers of one kind stacked and scanned, else one module per layer."""

    def tensor_name(self, stored: str) -> str:
        """The name the parameter spec asks for of a tensor stored as ``stored`` (checkpoints that
        come in several naming forms are read under one; most families return ``stored``)."""

    def mtp_layers(self, cfg, has_tensor) -> int:
        """How many next-n layers the checkpoint ships (``has_tensor(name)`` asks the files)."""

    def param_spec(self, cfg, model: nnx.Module) -> dict[Path, Spec]:
        """Checkpoint source of every parameter of ``model`` (keyed by state path)."""

    def cache_spec(self, cfg, kv_format: str = "model") -> CacheSpec:
        """What the cache holds per token (and per sequence); the engine sizes and allocates it.
        ``kv_format``: ``'model'`` (rows in the model's dtype) or ``'fp8'``
        (:func:`jaxdsa.cache.kv_cache_format`); a family without an FP8 layout raises ValueError."""

    def mtp_cache_spec(self, cfg, kv_format: str = "model") -> CacheSpec:
        """The same for the next-n layers."""

    def hidden(
        self, model: nnx.Module, tokens, positions, cache: Cache, meta: StepMeta, mode
    ) -> tuple[Any, Cache]:
        """The model over a step's T tokens: what the LM head (and the next-n layers) read of every
        token (T rows of a family-specific shape), and the updated cache."""

    def logits(self, model: nnx.Module, hidden) -> jax.Array:
        """Float32 logits [R, vocab] of rows of :meth:`hidden`."""

    def step(
        self, model: nnx.Module, tokens, positions, cache: Cache, meta: StepMeta, mode
    ) -> tuple[jax.Array, Cache]:
        """One step: float32 logits [R, vocab] at ``meta.logits_indices`` and the updated cache
        (every family's: :meth:`hidden`, then :meth:`logits` of the rows asked for)."""
        hidden, cache = self.hidden(model, tokens, positions, cache, meta, mode)
        return self.logits(model, hidden[meta.logits_indices]), cache

    def draft(
        self, model: nnx.Module, hidden, tokens, positions, cache: Cache, meta: StepMeta, mode, layer: int
    ) -> tuple[jax.Array, Any, Cache]:
        """Next-n layer ``layer`` over ``hidden`` (of token t) and ``tokens`` (t + 1) at ``positions`` with
        the next-n cache: (logits for t + 2, its own output to draft further from, both at
        ``meta.logits_indices``; the cache)."""

    def step_mode(self, cfg, *, max_position: int, single_sequence: bool = False) -> Hashable:
        """The static variant of the step for a batch whose longest context ends at ``max_position``."""

    def modes(self, cfg, max_model_len: int) -> list[Hashable]:
        """Every mode the engine can meet up to ``max_model_len`` (compiled at warm-up)."""

    def mode_context(self, cfg, mode) -> int | None:
        """How many positions a step in ``mode`` reaches (every position it holds is below this), or
        None where any context can take the mode. A sequence puts at most that many tokens in such a
        step, so it bounds the step's page-table columns and the token buckets warm-up compiles."""
        return None

    def page_columns(self, cfg, mode, page_size: int, columns: int) -> int:
        """How many page-table columns a step in ``mode`` needs out of ``columns``."""
        context = self.mode_context(cfg, mode)
        return columns if context is None else min(columns, -(-context // page_size))

    def page_size(self, cfg, requested: int | None) -> int:
        """The cache page size: ``requested`` (vLLM's ``--block-size``) if the family's cache can use
        it (ValueError otherwise), or its default."""
        return DEFAULT_PAGE_SIZE if requested is None else requested

    def prefix_caching(self, cfg) -> bool:
        """Whether a request can resume from cached pages of a shared prefix (False when the cache
        also keeps per-sequence state that the pages do not hold)."""
        return True

    def decode_traffic(
        self, cfg, par: Parallelism, batch: int, context: int, kv_format: str = "model"
    ) -> dict[str, float]:
        """For the planner: per-device cache bytes read (rows in ``kv_format``) and collective bytes
        of one decode step, and the routing fan-out (``experts_per_token``, ``num_experts``) for the
        expert reads."""


def check_splits(model: str, splits: Mapping[str, tuple[int, str]], par: Parallelism) -> None:
    """Config fields whose dims are split and never padded: ``splits`` maps each field's name to its
    size and logical axis. A size that does not divide into the axis' shards is a ValueError naming
    the field, before a mesh is laid out that would cut a head (or expert) in two."""
    for field, (size, axis) in splits.items():
        if size % par.shards(axis):
            raise ValueError(
                f"{model}: {field} = {size} does not split evenly into {par.shards(axis)} shards "
                f"(tp={par.tp}, ep={par.ep}, dp={par.dp}{', dp attention' if par.dp_attention else ''})"
            )


def param_axes(model: nnx.Module) -> dict[Path, Axes]:
    """Logical axes of every parameter, checked: a parameter without axes, or with a name that has
    no rule in :data:`jaxdsa.sharding.RULES`, is an error naming it."""
    out = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        out[path] = sharding.check_axes(axes_of(variable), "/".join(map(str, path)))
    return out


def abstract(
    family: ModelFamily,
    cfg,
    *,
    dtype,
    parallelism: Parallelism | None,
    mtp: int,
    scan_layers: bool = True,
) -> nnx.Module:
    """The model with ShapeDtypeStruct leaves: its structure, shapes and axes, no memory."""
    build = lambda: family.build(
        cfg, dtype=dtype, rngs=nnx.Rngs(0), parallelism=parallelism, mtp=mtp, scan_layers=scan_layers
    )
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(build)


def targets(model: nnx.Module, mesh) -> dict[Path, Any]:
    """Every parameter's shape, dtype and sharding (from its logical axes) on ``mesh`` (or one
    device): a ShapeDtypeStruct, or for a quantized weight a QuantizedWeight of them (one sharding
    for all its leaves)."""
    axes = param_axes(model)
    out = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        placed = sharding.named(mesh, axes[path])
        out[path] = jax.tree.map(
            lambda a, placed=placed: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed),
            variable.get_value(),
        )
    return out


def fill(model: nnx.Module, arrays: Mapping[Path, jax.Array]) -> nnx.Module:
    """``model`` (abstract) with every parameter set to its array."""
    graphdef, state = nnx.split(model)
    flat = [(path, v.replace(arrays[path]) if path in arrays else v) for path, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def collective_bytes(
    par: Parallelism,
    *,
    batch: int,
    hidden: int,
    layers: int,
    moe_layers: int,
    indexer_rows: int,
    experts_per_token: int,
) -> float:
    """Per device, the collective bytes of one decode step of ``batch`` sequences per dp group under
    the rules of :mod:`jaxdsa.sharding` (ring all-reduce: ``2 (n - 1) / n`` of the bytes reduced):
    per layer the attention output and the MLP / shared-expert output (bf16), the embedding lookup
    (f32), the indexer's head-sum over ``indexer_rows`` scored keys per sequence (f32, all layers
    together), the routed experts' partial sums (f32) and, with dp attention, the all-gather of the
    groups' tokens and the reduce-scatter of their outputs."""
    sizes = par.axis_sizes
    ring = 2 * (par.tp - 1) / par.tp if par.tp > 1 else 0.0
    D = hidden
    total = ring * (layers * 2 * batch * D * 2 + batch * D * 4 + batch * indexer_rows * 4)
    ep_shards = sizes["rep"] * sizes["tpe"]  # expert shards inside a group
    moe_tokens = batch * sizes["edp"]
    if ep_shards > 1:
        total += 2 * (ep_shards - 1) / ep_shards * moe_layers * moe_tokens * D * 4
    if sizes["edp"] > 1:  # tokens (bf16) + ids / weights out, f32 outputs back
        total += (sizes["edp"] - 1) * moe_layers * batch * (D * 2 + experts_per_token * 8 + D * 4)
    return total
