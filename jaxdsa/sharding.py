"""Sharding, declared once: logical axis names -> mesh axes, the mesh, and shard_map wrappers.

Parallelism ``(tp, ep, dp)`` maps onto one mesh with five axes:

- ``dp``: data parallel. Each dp group is an independent replica of the step over its own
  slice of the batch and of the cache pages; the step runs as a shard_map that is manual over
  the data-parallel axes, so everything inside sees group-local tokens, page tables and pages.
- ``edp``: data-parallel attention groups that share one set of experts (``dp_attention``, as in
  SGLang's ``--enable-dp-attention``): batch and cache pages split like ``dp``, but the routed
  experts are split over ``edp`` too. Each MoE layer all-gathers the groups' tokens over ``edp``,
  runs the slots routed to the local experts, and reduce-scatters the partial outputs back
  (vLLM's "allgather-reducescatter" dispatch and combine). The latent cache is then held once per
  group instead of once per TP device, and no expert is stored twice.
- ``tpe`` x ``tpi`` = ``tp``: attention heads, indexer heads, KDA (linear-attention) heads, dense /
  shared-expert MLP columns and the vocabulary are split over both. Routed experts are split over
  ``tpe`` (and ``rep``), their intermediate dimension over ``tpi`` (expert tensor parallelism when
  ep < tp).
- ``rep``: only when the group's expert factor exceeds tp: attention is replicated over it.

``ep`` counts all expert shards. Without dp_attention they live inside each dp group, so ``ep``
either divides ``tp`` or is a multiple of it and the mesh has dp * tp * max(1, ep/tp) devices:
(tp, ep, dp) = (4, 2, 1) -> 4 devices, experts over 2 x expert-TP 2; (2, 4, 1) -> 4. With
dp_attention each of the dp groups holds ``ep / dp`` of them: (1, 8, 8) -> 8 devices, one
eighth of the experts each; (2, 4, 2) -> 4 devices.

Model code names logical axes only: every parameter carries its names as metadata, activations
are pinned with :func:`constrain`, and each op of :mod:`jaxdsa.ops` declares the axes of its
operands (:class:`OpSharding`). :data:`RULES` is the one place that turns names into mesh axes;
a name missing from it is an error, never a silent replication. Kernels are not
auto-partitioned, so :func:`wrap_op` runs each op under shard_map over the axes still automatic.

An op whose shards each compute a partial sum (a row-parallel projection, the routed experts)
all-reduces it by default; called with ``unreduced=True`` it returns the shards' partial sums as a
:class:`Partial` instead, and :func:`reduce_partials` adds several of them before one all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("dp", "edp", "rep", "tpe", "tpi")
DP_AXES = ("dp", "edp")  # the step is manual over these (data_parallel)
TP_AXES = ("tpe", "tpi")
EXPERT_AXES = ("edp", "rep", "tpe")

Axes = tuple[str | None, ...]

# Logical axis name -> mesh axes. Every name a parameter, cache or activation uses is listed;
# an empty tuple means "never split".
RULES: dict[str, tuple[str, ...]] = {
    # split
    "batch": DP_AXES,  # tokens / sequences of a step, step outputs
    "cache_pages": DP_AXES,  # pages of the paged cache: each dp group owns its own
    "cache_seqs": DP_AXES,  # sequences of a per-sequence cache ring: as their pages
    "heads": TP_AXES,
    "index_heads": TP_AXES,
    "mlp": TP_AXES,  # dense MLP and shared-expert intermediate
    "vocab": TP_AXES,
    "experts": EXPERT_AXES,
    "expert_mlp": ("tpi",),
    # never split
    "layers": (),  # stacked (scanned) layers; also the layer axis of the cache
    "embed": (),  # model width
    "embed_pair": (),  # the MTP projection's [embedding ; hidden] input
    "q_lora": (),
    "kv_lora": (),
    "latent": (),  # kv_lora + rope: one cached latent row
    "head_dim": (),
    "index_head_dim": (),
    "router_experts": (),  # the router scores every expert on every device
    "page": (),
    "ring": (),  # rows of a per-sequence cache ring
    "cache_width": (),
    # DeepSeek-V4: heads, index heads, experts, the shared expert and the vocabulary split as above;
    # the output projection's rank concatenated over the head groups is row-parallel like ``heads``.
    # The rest is small and replicated: the one K = V head, the compressors, the HC mixing.
    "o_rank": TP_AXES,  # wo_b's input: the groups' low-rank outputs, concatenated (head order)
    "o_lora": (),  # one group's low rank (wo_a's output)
    "hc_flat": (),  # the n hyper-connection streams flattened [n D]: input of an HC site's mixing
    "hc_mix": (),  # an HC site's mixing outputs (pre, post, comb), their bases and scales
    "compress_window": (),  # a compressor's window offsets (its ``ape`` rows)
    "compress_width": (),  # a compressor's projected row (one or two halves of head_dim)
    "hash_vocab": (),  # the hash-routing table's token axis (looked up by token id)
    "experts_per_token": (),
    # GLM-5.3-Flash's KDA layers: heads split like attention heads (their projections, short-conv
    # channels, per-head gates, the per-sequence state and conv ring; o_proj row-parallel). The KDA
    # cache entries name their flat width by it: head-major, so a contiguous split holds whole heads.
    "linear_heads": TP_AXES,
    "linear_head_dim": (),
    "linear_rank": (),  # the forget gate's and the output gate's rank-K bottleneck
    "conv_taps": (),  # the short convolution's taps
}


def check_axes(axes: Any, what: str) -> Axes:
    """``axes`` as a tuple of known logical names, or a ValueError naming ``what``."""
    if not isinstance(axes, tuple) or not axes:
        raise ValueError(
            f"{what}: has no logical axis names (got {axes!r}); every parameter must declare them"
        )
    unknown = [a for a in axes if a not in RULES]
    if unknown:
        raise ValueError(f"{what}: logical axes {unknown} have no rule in jaxdsa.sharding.RULES")
    return axes


@dataclasses.dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    ep: int = 1
    dp: int = 1
    dp_attention: bool = False  # the dp groups share the experts (split over all of them)

    def __post_init__(self):
        for name in ("tp", "ep", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.dp_attention and self.ep % self.dp:
            raise ValueError(
                f"with dp_attention, ep ({self.ep}) counts the expert shards of all {self.dp} dp "
                "groups: it must be a multiple of dp"
            )
        ep = self.group_ep
        if self.tp % ep and ep % self.tp:
            within = " per dp group" if self.dp_attention else ""
            raise ValueError(f"ep{within} ({ep}) must divide tp ({self.tp}) or be a multiple of it")

    @property
    def group_ep(self) -> int:
        """Expert shards inside one dp group."""
        return self.ep // self.dp if self.dp_attention else self.ep

    @property
    def axis_sizes(self) -> dict[str, int]:
        ep = self.group_ep
        rep = ep // self.tp if ep > self.tp else 1
        tpe = min(ep, self.tp)
        dp, edp = (1, self.dp) if self.dp_attention else (self.dp, 1)
        return {"dp": dp, "edp": edp, "rep": rep, "tpe": tpe, "tpi": self.tp // tpe}

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes.values())

    def shards(self, name: str) -> int:
        """How many pieces the logical axis ``name`` is cut into."""
        sizes = self.axis_sizes
        return math.prod(sizes[a] for a in RULES[name])


def make_mesh(par: Parallelism, devices=None) -> Mesh:
    """The one place meshes are built (all axes Auto: XLA propagates shardings between ops)."""
    devices = jax.devices() if devices is None else devices
    if len(devices) < par.num_devices:
        raise ValueError(
            f"tp={par.tp} ep={par.ep} dp={par.dp} needs {par.num_devices} devices, found {len(devices)}"
        )
    sizes = par.axis_sizes
    grid = np.asarray(devices[: par.num_devices]).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def spec(logical: Axes, *, exclude: tuple[str, ...] = ()) -> P:
    """PartitionSpec for logical dims (None: not split); mesh axes in ``exclude`` are dropped."""
    out = []
    for name in logical:
        axes = tuple(a for a in RULES[name] if a not in exclude) if name is not None else ()
        out.append(axes if len(axes) > 1 else (axes[0] if axes else None))
    return P(*out)


def shard_shape(shape: tuple[int, ...], logical: Axes, par: Parallelism) -> tuple[int, ...]:
    """Per-device shape of an array of ``shape`` laid out by ``logical`` (no devices needed)."""
    return tuple(-(-d // (par.shards(n) if n else 1)) for d, n in zip(shape, logical))


def named(mesh: Mesh | None, logical: Axes) -> jax.sharding.Sharding:
    """The sharding of an array with ``logical`` axes: on ``mesh``, or on the default device."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, spec(logical))


# ---- activations and kernels inside the step ---------------------------------------------------


def _mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or math.prod(mesh.shape.values()) == 1 else mesh


def constrain(x: jax.Array, logical: Axes) -> jax.Array:
    """Pin an activation's layout by logical names (a no-op outside a mesh)."""
    mesh = _mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec(logical, exclude=tuple(mesh.manual_axes)))


def _auto_axes(mesh) -> tuple[str, ...]:
    """Mesh axes of size > 1 that the enclosing code has not taken manual (the shard_map's axes)."""
    return tuple(a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1)


def on_every_device(fn: Callable[..., Any], args: tuple, axes: tuple[str, ...], split: int = 0) -> Any:
    """``fn(*args, first)`` on each device of the step's mesh, for host callbacks, which run only
    where every mesh axis is manual. ``first``: whether the device is the first along the mesh
    ``axes`` (devices along its other axes hold copies). Each output gets a leading dim split over
    ``axes`` (size 1 per device), so devices along them return their own values; the first ``split``
    operands come in that form (an earlier call's outputs), the others replicated. Off a mesh:
    ``fn(*args, True)``, its outputs given that dim of 1."""
    mesh = _mesh()
    lead = lambda out: jax.tree.map(lambda o: o[None], out)  # noqa: E731
    if mesh is None:
        return lead(fn(*args, jnp.bool_(True)))
    manual = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)

    def local(*operands):
        first = functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in axes], jnp.bool_(True))
        return lead(fn(*operands, first))

    own = P(axes or None)
    smap = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(own if i < split else P() for i in range(len(args))),
        out_specs=own,
        axis_names=set(manual),
        check_vma=False,
    )
    return smap(*args)


def mesh_axis_names() -> tuple[str, ...]:
    """The step's mesh axes not manual already (none off a mesh): with :func:`on_every_device`, the
    first device alone, or where the step is already split by hand over dp groups, each group's."""
    mesh = _mesh()
    return () if mesh is None else tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)


def partial_axes(*names: str) -> tuple[str, ...]:
    """The mesh axes a partial sum over the logical ``names`` spans on the step's mesh (none off a
    mesh): the axes of the :class:`Partial` an op with ``reduce=names`` returns."""
    mesh = _mesh()
    if mesh is None:
        return ()
    live = _auto_axes(mesh)
    return tuple(a for name in names for a in RULES[name] if a in live)


@dataclasses.dataclass(frozen=True)
class OpSharding:
    """How an op's operands split over the mesh, in logical names (see :mod:`jaxdsa.ops`).

    ``args`` / ``kwargs``: per array operand its logical axes (None for a dim or operand that is
    not split; a dict of axes for a dict operand). ``out``: axes of the output (a tuple of them
    for several outputs). ``reduce``: logical names whose shards each produce a partial output,
    summed across them (in float32). ``index_args``: operands holding ids into a split logical
    axis; each shard sees them shifted into its own range (ids outside it must be ignored by the
    op). ``across_dp``: how the op meets the other dp-attention groups when the routed experts are
    split over them (see :data:`_ACROSS_DP`).
    """

    args: tuple[Any, ...]
    out: Any
    kwargs: Mapping[str, Axes] = dataclasses.field(default_factory=dict)
    reduce: tuple[str, ...] = ()
    index_args: Mapping[int, str] = dataclasses.field(default_factory=dict)
    across_dp: str | None = None

    def with_layer_stacks(self, *weights: int) -> OpSharding:
        """The same op given the operands at positions ``weights`` as whole stacks over scanned
        layers plus a ``layer`` index keyword: every leaf of those operands gets one leading
        ``layers`` dim (never split), and the index is replicated."""
        lead = lambda axes: jax.tree.map(lambda ax: ("layers", *ax), axes, is_leaf=_is_axes)  # noqa: E731
        args = tuple(lead(axes) if i in weights else axes for i, axes in enumerate(self.args))
        return dataclasses.replace(self, args=args, kwargs={**self.kwargs, "layer": ()})


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _dim_size(sharding: OpSharding, args: tuple, name: str) -> int:
    """Size of logical axis ``name`` in the operands (the first operand declaring it). An operand's
    axes may be a prefix of it: one tuple for a quantized weight, whose ``shape`` is the logical one."""
    for axes, arg in zip(sharding.args, args):
        if axes is None:
            continue
        for ax, part in zip(
            jax.tree.leaves(axes, is_leaf=_is_axes),
            jax.tree.structure(axes, is_leaf=_is_axes).flatten_up_to(arg),
        ):
            if ax is not None and name in ax:
                return part.shape[ax.index(name)]
    raise ValueError(f"no operand declares logical axis {name!r}")


def _shifted(args: tuple, sharding: OpSharding, mesh_axes_of: Callable[[str], tuple[str, ...]]) -> tuple:
    """Index operands shifted into the local range of the axis they index (local sizes)."""
    args = list(args)
    for i, name in sharding.index_args.items():
        axes = mesh_axes_of(name)
        if axes:
            local = _dim_size(sharding, tuple(args), name)
            args[i] = args[i] - jax.lax.axis_index(axes) * local
    return tuple(args)


@dataclasses.dataclass(frozen=True)
class Partial:
    """An op's output before its sum over the shards that split its contraction: ``value``
    ``[S, ...]`` float32 holds one partial sum per shard of the mesh ``axes`` (S their sizes'
    product), split over them on its leading dim; ``axes == ()`` and S = 1 when nothing was split.

    At decode an all-reduce is a launch outside the CUDA graphs plus its own small kernels (the
    cast before it, the cast after it), so sums that meet anyway go through one: the routed and the
    shared experts' down projections add their partial sums first (:func:`reduce_partials`)."""

    value: jax.Array
    axes: tuple[str, ...] = ()

    @staticmethod
    def whole(out: jax.Array) -> Partial:
        """An output that is already complete on every device."""
        return Partial(out.astype(jnp.float32)[None])


def reduce_partials(parts: Partial | Any) -> jax.Array:
    """The float32 sum of ``parts`` (a :class:`Partial` or a sequence of them): those split over
    the same mesh axes are added shard by shard, then each such group is summed over its shards
    (one all-reduce per group), then the groups are added."""
    groups: dict[tuple[str, ...], jax.Array] = {}
    for p in [parts] if isinstance(parts, Partial) else parts:
        groups[p.axes] = groups[p.axes] + p.value if p.axes in groups else p.value
    sums = [value.sum(axis=0) for value in groups.values()]
    return functools.reduce(lambda a, b: a + b, sums)


def _sharded_call(sharding: OpSharding, fn: Callable, mesh, args: tuple, kwargs: dict, unreduced: bool):
    """``fn`` under shard_map over the mesh's automatic axes, as ``sharding`` declares; with
    ``unreduced``, its outputs as :class:`Partial` s (each shard's partial sum, not all-reduced)."""
    live = _auto_axes(mesh)
    dead = tuple(a for a in MESH_AXES if a not in live)

    def to_spec(axes):
        if axes is None:
            return P()
        return jax.tree.map(lambda ax: spec(ax, exclude=dead), axes, is_leaf=_is_axes)

    array_kw = {k: v for k, v in kwargs.items() if k in sharding.kwargs}
    static_kw = {k: v for k, v in kwargs.items() if k not in sharding.kwargs}
    kw_specs = {k: None if v is None else to_spec(sharding.kwargs[k]) for k, v in array_kw.items()}
    in_specs = (*(to_spec(ax) for ax in sharding.args), kw_specs)
    reduce_axes = tuple(a for name in sharding.reduce for a in RULES[name] if a in live)

    static_args = args[len(sharding.args) :]  # positional operands past the declared ones (e.g. top-k's k)

    def local(*operands):
        *positional, kw = operands
        positional = _shifted(tuple(positional), sharding, lambda n: tuple(a for a in RULES[n] if a in live))
        out = fn(*positional, *static_args, **kw, **static_kw)
        if reduce_axes and unreduced:
            return jax.tree.map(lambda o: o.astype(jnp.float32)[None], out)
        if reduce_axes:
            out = jax.tree.map(
                lambda o: jax.lax.psum(o.astype(jnp.float32), reduce_axes).astype(o.dtype), out
            )
        return out

    out_specs = to_spec(sharding.out)
    if reduce_axes and unreduced:  # one partial sum per shard, split on a new leading dim
        out_specs = jax.tree.map(lambda p: P(reduce_axes, *p), out_specs, is_leaf=lambda x: isinstance(x, P))
    smap = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(live),
        check_vma=False,
    )
    out = smap(*args[: len(sharding.args)], array_kw)
    if not unreduced:
        return out
    if not reduce_axes:
        return jax.tree.map(Partial.whole, out)
    return jax.tree.map(lambda o: Partial(o, reduce_axes), out)


def _gather_tokens_across_edp(sharding: OpSharding, call: Callable, args: tuple, kwargs: dict):
    """Dispatch and combine across dp-attention groups (inside the step's edp-manual shard_map):
    all-gather every group's operands, run the ids that fall in this group's slice of the indexed
    axis (``call`` may split them further over the group's own axes), reduce-scatter the partial
    outputs back to the groups they came from. Exact: each id is computed by exactly one group."""
    ((index_arg, name),) = sharding.index_args.items()
    local_size = _dim_size(sharding, args, name)
    gather = functools.partial(jax.lax.all_gather, axis_name="edp", axis=0, tiled=True)
    gathered = [gather(a) if ax is None else a for a, ax in zip(args, sharding.args)]
    gathered[index_arg] = gathered[index_arg] - jax.lax.axis_index("edp") * local_size
    out = call(*gathered, **kwargs)
    # float32 collective: XLA:CPU has no bf16 reduce-scatter, and the sum is exact in f32 anyway
    summed = jax.lax.psum_scatter(out.astype(jnp.float32), "edp", scatter_dimension=0, tiled=True)
    return summed.astype(out.dtype)


# Strategies for ops whose operands differ per dp-attention group and must meet across the groups.
_ACROSS_DP = {"gather_tokens": _gather_tokens_across_edp}


def wrap_op(sharding: OpSharding, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run an op implementation under shard_map when the step is traced on a mesh. The wrapped op
    takes ``unreduced=True`` to return :class:`Partial` s instead of all-reduced outputs."""

    @functools.wraps(fn)
    def wrapped(*args, unreduced: bool = False, **kwargs):
        mesh = _mesh()
        whole = (lambda out: jax.tree.map(Partial.whole, out)) if unreduced else (lambda out: out)
        if mesh is None:
            return whole(fn(*args, **kwargs))
        auto = bool(_auto_axes(mesh))
        if sharding.across_dp and mesh.shape["edp"] > 1:
            call = (lambda *a, **k: _sharded_call(sharding, fn, mesh, a, k, False)) if auto else fn
            return whole(_ACROSS_DP[sharding.across_dp](sharding, call, args, kwargs))
        if auto:
            return _sharded_call(sharding, fn, mesh, args, kwargs, unreduced)
        return whole(fn(*args, **kwargs))

    return wrapped


def embed_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Vocab-parallel embedding: each TP shard looks up the ids in its row range, then one psum."""
    mesh = _mesh()
    tp = None if mesh is None else tuple(a for a in TP_AXES if a in _auto_axes(mesh)) or None
    if tp is None:
        return table[ids]
    rows = table.shape[0] // math.prod(mesh.shape[a] for a in tp)

    def f(t, i):
        local = i - jax.lax.axis_index(tp) * rows
        hit = (local >= 0) & (local < rows)
        rows_f32 = jnp.where(hit[:, None], t[jnp.where(hit, local, 0)], 0).astype(jnp.float32)
        return jax.lax.psum(rows_f32, tp).astype(t.dtype)  # exact: one shard contributes each row

    smap = jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(P(tp, None), P()),
        out_specs=P(),
        axis_names=set(_auto_axes(mesh)),
        check_vma=False,
    )
    return smap(table, ids)


# ---- the step over data-parallel groups --------------------------------------------------------


def group_spec(logical: Axes) -> P:
    """The spec of an operand of the dp-group shard_map: only its data-parallel split. Inside a
    group the other axes stay automatic (XLA propagates them from the arrays' own shardings)."""
    within_group = tuple(a for a in MESH_AXES if a not in DP_AXES)
    return spec(logical, exclude=within_group)


def jit_step(
    fn: Callable[..., Any],
    mesh: Mesh | None,
    donate_argnums: tuple[int, ...],
    in_axes: tuple[Any, ...] = (),
    out_axes: Any = None,
) -> Callable[..., Any]:
    """jit a step ``fn(*args)``; on a mesh, as data-parallel groups traced with the mesh set (so
    the shard_map wrappers of :mod:`jaxdsa.ops` see it). ``in_axes`` gives, per argument, a
    pytree of logical axes (tuples), or None for a batch argument whose every leaf is split on
    its leading dim (arguments past ``in_axes`` are batch arguments); ``out_axes`` is a pytree
    prefix of the outputs in the same terms (None: every output is batch-split)."""
    if mesh is None:
        return jax.jit(fn, donate_argnums=donate_argnums)

    def specs(axes):
        return batch_spec() if axes is None else jax.tree.map(group_spec, axes, is_leaf=_is_axes)

    def run(*args):
        in_specs = tuple(specs(in_axes[i] if i < len(in_axes) else None) for i in range(len(args)))
        out_specs = (
            specs(None)
            if out_axes is None
            else jax.tree.map(specs, out_axes, is_leaf=lambda x: x is None or _is_axes(x))
        )
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(DP_AXES), check_vma=False
        )(*args)

    # named after the step (a function or a partial of one), as jit names it without a mesh
    run.__name__ = run.__qualname__ = getattr(fn, "func", fn).__name__
    return _OnMesh(jax.jit(run, donate_argnums=donate_argnums), mesh)


class _OnMesh:
    """A jitted function called (and lowered) with its mesh set, as the op wrappers expect."""

    def __init__(self, jitted, mesh: Mesh):
        self.jitted, self.mesh = jitted, mesh

    def __call__(self, *args):
        with jax.sharding.set_mesh(self.mesh):
            return self.jitted(*args)

    def lower(self, *args):
        with jax.sharding.set_mesh(self.mesh):
            return self.jitted.lower(*args)


def batch_spec() -> P:
    """Leading dim split over the data-parallel groups: batches, step outputs."""
    return spec(("batch",))


def dp_groups(mesh: Mesh | None) -> int:
    """Number of data-parallel groups (each with its own requests and cache pages)."""
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in DP_AXES)


def mesh_shards(mesh: Mesh | None) -> Callable[[str], int] | None:
    """How many pieces a logical axis is cut into on ``mesh`` (:meth:`Parallelism.shards` of a built
    mesh); None off a mesh, where nothing is cut."""
    if mesh is None:
        return None
    return lambda name: math.prod(mesh.shape[a] for a in RULES[name])


# ---- host <-> device on meshes that may span processes --------------------------------------------


def put(tree: Any, mesh: Mesh, partition: P) -> Any:
    """Place host arrays with ``partition`` on ``mesh``; every process passes the same values and
    keeps only its own devices' slices (works single- and multi-process)."""
    target = NamedSharding(mesh, partition)

    def one(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, target, lambda index: host[index])

    return jax.tree.map(one, tree)


def fetch(x: jax.Array) -> np.ndarray:
    """The whole value of ``x`` on this host, gathering other processes' shards if needed."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
