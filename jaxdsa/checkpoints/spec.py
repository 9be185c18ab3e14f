"""Parameter specs: where each parameter of a model comes from in a checkpoint.

A model family describes its parameters as a flat mapping from parameter path (the path of the
parameter in the model's state) to one of these leaves. The one generic walker
(:mod:`jaxdsa.checkpoints.walker`) reads them to load a checkpoint, draws dummy weights from them, and
the planner counts their bytes; nothing else in the project knows checkpoint names.

``view`` functions turn a tensor in the file's layout into ours using only views (transpose,
splitting a dimension, slicing rows), so a device's slice is read straight from the mapped file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import numpy as np

View = Callable[[np.ndarray], np.ndarray]


def transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def as_stored(w: np.ndarray) -> np.ndarray:
    """[out, in] kept as the file holds it: a MoE router's ``[E, D]``, one row per expert, so a
    decode step's logits are row reductions (one XLA kernel; ``[D, E]`` columns took two)."""
    return w


def transpose_split(*dims: int) -> View:
    """[out, in] -> [in, *dims] where prod(dims) == out (e.g. q_b -> [q_lora, H, qk])."""
    return lambda w: w.T.reshape((w.shape[1], *dims))


def transpose_merge(*dims: int) -> View:
    """[out, prod(dims)] -> [*dims, out] (e.g. o_proj [D, H*v] -> [H, v, D])."""
    return lambda w: w.T.reshape((*dims, w.shape[0]))


@dataclasses.dataclass(frozen=True)
class Linear:
    """An HF linear weight ``{name}.weight`` [out, in]: plain, FP8-block or INT4-packed in the file.

    ``pad``: the model may hold more (zero) entries than the file along some dims (attention heads
    padded to a multiple of the tensor-parallel shards). ``rows = (period, start, stop)``: the
    parameter holds only rows ``[start, stop)`` of every ``period`` rows (one part of each head,
    :func:`head_part`); ``view`` still takes the whole ``[out, in]`` tensor.
    """

    name: str
    out: int
    inp: int
    view: View = transpose
    pad: bool = False
    rows: tuple[int, int, int] | None = None

    @property
    def kept_out(self) -> int:
        """How many of the file's ``out`` rows the parameter holds."""
        if self.rows is None:
            return self.out
        period, start, stop = self.rows
        return self.out // period * (stop - start)


def head_part(name: str, heads: int, per_head: int, start: int, stop: int, inp: int) -> Linear:
    """Rows ``[start, stop)`` of every head of the linear ``name`` ``[heads * per_head, inp]`` as a
    ``[inp, heads, stop - start]`` parameter (``kv_b``'s W_UK and W_UV parts): a view when dense,
    the same columns of the repacked matrix when kept quantized."""

    def view(w: np.ndarray) -> np.ndarray:
        return w.reshape(heads, per_head, inp)[:, start:stop].transpose(2, 0, 1)

    return Linear(name, heads * per_head, inp, view, pad=True, rows=(per_head, start, stop))


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor stored as is (norm weights, biases, embeddings). ``init`` says how dummy weights
    are drawn: "embed" N(0, 1), "norm" 1 + N(0, 0.1^2), "bias" N(0, 0.1^2)."""

    name: str
    shape: tuple[int, ...]
    init: str = "norm"
    view: View | None = None


# Per-expert module names of (gate, up, down): HF's, and DeepSeek-V4's release names (w1, w3, w2).
HF_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
V4_EXPERT_NAMES = ("w1", "w3", "w2")


@dataclasses.dataclass(frozen=True)
class _Experts:
    """Routed experts stored per expert as ``{prefix}.{e}.{module}.weight``. ``names``: the
    per-expert module names (gate, up, down). ``fp4``: the checkpoint may store them as DeepSeek-V4
    FP4 (packed e2m1 bytes plus ue8m0 scales per 32 inputs, docs/models.md §4.6). ``ids``: the
    checkpoint experts the parameter holds, in its order (None: all ``num`` of them); experts split
    between the GPUs and host RAM (:mod:`jaxdsa.offload`) hold a subset on each side. ``shared``:
    the module names (gate, up, down) of a shared expert held after the routed ones, one more
    expert of the same shape (:mod:`jaxdsa.shared_experts`)."""

    prefix: str
    num: int
    inter: int
    hidden: int
    names: tuple[str, str, str] = HF_EXPERT_NAMES
    fp4: bool = False
    ids: tuple[int, ...] | None = None
    shared: tuple[str, str, str] | None = None
    projections: ClassVar[tuple[str, ...]] = ()  # what the parameter holds, of gate / up / down

    @property
    def positions(self) -> int:
        """How many experts the parameter holds (its expert axis)."""
        return (self.num if self.ids is None else len(self.ids)) + (self.shared is not None)

    def is_shared(self, e: int) -> bool:
        """Whether position ``e`` holds the shared expert."""
        return self.shared is not None and e == self.positions - 1

    def source(self, e: int) -> int:
        """The checkpoint expert held at position ``e`` of the parameter (a routed one)."""
        return e if self.ids is None else self.ids[e]

    def module(self, proj: str, e: int) -> str:
        """The module name of the ``proj`` (gate / up / down) projection held at position ``e``."""
        which = ("gate", "up", "down").index(proj)
        if self.is_shared(e):
            return self.shared[which]
        return f"{self.prefix}.{self.source(e)}.{self.names[which]}"


@dataclasses.dataclass(frozen=True)
class ExpertGateUp(_Experts):
    """Routed experts' gate and up projections ``{prefix}.{e}.{gate,up}_proj.weight`` [N, D], packed
    ``[E, D, 2N]``. A device holding columns ``[c0, c1)`` of the packed axis split in ``s`` equal
    pieces holds ``[gate_j | up_j]`` for piece ``j``: expert tensor parallelism keeps each shard's
    gate and up columns side by side, the layout the kernel expects locally."""

    projections: ClassVar[tuple[str, ...]] = ("gate", "up")


@dataclasses.dataclass(frozen=True)
class ExpertDown(_Experts):
    """Routed experts' down projections ``{prefix}.{e}.down_proj.weight`` [D, N] as ``[E, N, D]``."""

    projections: ClassVar[tuple[str, ...]] = ("down",)


@dataclasses.dataclass(frozen=True)
class IndexTable:
    """An integer table stored as is and held as int32 with every value in ``[0, bound)``
    (DeepSeek-V4's hash routing ``tid2eid`` [vocab, k]: expert ids per token). Dummy tables hold
    ``k`` distinct values per row."""

    name: str
    shape: tuple[int, ...]
    bound: int


Leaf = Linear | Tensor | ExpertGateUp | ExpertDown | IndexTable


@dataclasses.dataclass(frozen=True)
class Stacked:
    """Scanned layers: the parameter stacks one leaf per layer on a leading axis."""

    items: tuple[Leaf, ...]
    layers: tuple[int, ...]  # the model layer of each item (for progress reports)


Spec = Leaf | Stacked
