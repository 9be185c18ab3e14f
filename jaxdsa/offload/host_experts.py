"""Routed experts held in host RAM and computed on the CPU, inside the GPU step.

A MoE layer whose experts are split (:mod:`jaxdsa.offload.placement`) runs its routed experts on two
sides. The step stays one compiled program: two host callbacks per layer hand the CPU its work and
take its result back, and two optimization barriers order them around the GPU's own experts and the
shared expert, which run while the CPU computes:

    submit(x, slots, weights)  ->  GPU experts + shared expert  ->  collect()  ->  sum

``submit`` copies the layer's tokens and routing to the host and queues the CPU computation on a
worker thread; ``collect`` waits for it and returns its float32 sum, which joins the layer's other
partial sums (:func:`jaxdsa.sharding.reduce_partials`). A callback is not a CUDA-graph command, so
each one splits the step's graphs, and it waits for the GPU work before it: the cost of a layer's
round trip is two such synchronizations plus the copies of ``x`` (``T x D``) there and back.

The CPU side computes what the GPU's experts compute (:mod:`jaxdsa.offload.cpu_moe`, held to
:func:`reference`): the weights stay in their checkpoint format (INT4 / FP8 / FP4 / NVFP4 codes with
their scales, or dense), held once, on JAX's CPU device, and the kernel reads them in place (NVFP4's
scales read as their float32 products with the global scales, formed at load).
"""

from __future__ import annotations

import functools
import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numba
import numpy as np

from jaxdsa import sharding
from jaxdsa.offload.cpu_moe import BLOCK, HostWeight, expert_matmul
from jaxdsa.quantized_weight import take_layer
from jaxdsa.sharding import Partial
from pallas_kernels.moe.ref import moe_experts

_WORKER = ThreadPoolExecutor(1, thread_name_prefix="jaxdsa-host-experts")
_TICKETS = itertools.count(1)


class HostExperts:
    """One :class:`~jaxdsa.layers.mlp.Experts` module's host-resident experts.

    ``experts``: ``{"gate_up": [L?, E_host, D, 2N], "down": [L?, E_host, N, D]}`` (arrays or
    QuantizedWeights on the CPU device; ``L`` when the module is a scanned stack); ``gpu``: how many
    experts the GPU stack holds (a routing slot ``s >= gpu`` is host expert ``s - gpu``); ``threads``:
    the kernel's (Numba's are per calling thread, so :meth:`compute` sets them; default all cores).
    Compared by identity: it is static data of the module tree, as the module's hyperparameters are.
    """

    def __init__(
        self,
        experts: dict[str, Any],
        *,
        gpu: int,
        stacked: bool,
        swiglu_limit: float | None,
        threads: int | None = None,
    ):
        self.experts, self.gpu, self.stacked, self.swiglu_limit = experts, gpu, stacked, swiglu_limit
        self.threads = threads or numba.config.NUMBA_NUM_THREADS
        self.block = BLOCK  # output columns per kernel task
        self.cpu = jax.tree.leaves(experts)[0].sharding
        layers = experts["down"].shape[0] if stacked else 1
        self._layers = [
            tuple(HostWeight.of(experts[name], i if stacked else None) for name in ("gate_up", "down"))
            for i in range(layers)
        ]
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()

    @property
    def num(self) -> int:
        """Experts per layer held in host RAM."""
        return self.experts["down"].shape[-3]

    # -- inside the traced step ----------------------------------------------------------------

    def submit(
        self,
        x: jax.Array,
        slots: jax.Array,
        weights: jax.Array,
        layer: jax.Array | None,
        axes: tuple[str, ...],
    ) -> jax.Array:
        """Queue the CPU's share of ``x``'s routed experts (``slots [T, k]`` as
        :func:`~jaxdsa.offload.placement.slot_table` gives them); -> tickets for :meth:`collect`.
        On a mesh the first device along ``axes`` (the mesh axes of the routed experts' partial
        sums) queues the work, the others return no ticket."""
        layer = jnp.zeros((), jnp.int32) if layer is None else layer
        ticket = jax.ShapeDtypeStruct((), jnp.int32)

        def local(x, slots, weights, layer, first):
            return jax.pure_callback(
                self._submit, ticket, x, slots, weights, layer, first, vmap_method="sequential"
            )

        return sharding.on_every_device(local, (x, slots, weights, layer), axes)

    def collect(self, tickets: jax.Array, x: jax.Array, axes: tuple[str, ...]) -> Partial:
        """The CPU's float32 sum ``[T, D]`` for ``tickets``, once computed: a partial sum over
        ``axes`` (the first device's, zeros elsewhere) that joins the routed experts' own."""
        out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
        collect = functools.partial(self._collect, shape=x.shape)  # static: no copy of x to the host

        def local(ticket, first):
            return jax.pure_callback(collect, out, ticket[0], vmap_method="sequential")

        return Partial(sharding.on_every_device(local, (tickets,), axes, split=1), axes)

    # -- on the host ---------------------------------------------------------------------------

    def _submit(self, x, slots, weights, layer, first) -> np.ndarray:
        if not first:
            return np.int32(-1)
        ticket = next(_TICKETS) % 2**31
        args = (np.asarray(x), np.asarray(slots), np.asarray(weights), int(layer))
        with self._lock:
            self._pending[ticket] = _WORKER.submit(self.compute, *args)
        return np.int32(ticket)

    def _collect(self, ticket, *, shape: tuple[int, ...]) -> np.ndarray:
        if ticket < 0:
            return np.zeros(shape, np.float32)
        with self._lock:
            future = self._pending.pop(int(ticket))
        return future.result()

    def compute(self, x: np.ndarray, slots: np.ndarray, weights: np.ndarray, layer: int) -> np.ndarray:
        """sum_j weights[t, j] * expert(slots[t, j] - gpu)(x[t]) over the host's slots, float32 [T, D]."""
        numba.set_num_threads(self.threads)
        T, k = slots.shape
        ids = (slots - self.gpu).reshape(-1)
        mine = np.flatnonzero((ids >= 0) & (ids < self.num))
        order = mine[np.argsort(ids[mine], kind="stable")]  # the host's slots, grouped by expert
        experts, counts = np.unique(ids[order], return_counts=True)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        tokens = order // k
        bf16 = x.dtype != np.float32
        gate_up, down = self._layers[layer if self.stacked else 0]
        h = expert_matmul(
            x[tokens].astype(np.float32), offsets, experts, gate_up, bf16, 2 * self.inter, self.block
        )
        gate, up = h[:, : self.inter], h[:, self.inter :]
        if self.swiglu_limit is not None:
            gate, up = np.minimum(gate, self.swiglu_limit), np.clip(up, -self.swiglu_limit, self.swiglu_limit)
        act = (gate / (1 + np.exp(-gate)) * up).astype(x.dtype).astype(np.float32)
        y = expert_matmul(act, offsets, experts, down, bf16, x.shape[1], self.block)
        out = np.zeros((T, x.shape[1]), np.float32)
        np.add.at(out, tokens, y * weights.reshape(-1)[order, None].astype(np.float32))
        return out

    @property
    def inter(self) -> int:
        """The experts' intermediate width N."""
        return self.experts["down"].shape[-2]

    def reference(self, x: np.ndarray, slots: np.ndarray, weights: np.ndarray, layer: int) -> np.ndarray:
        """:meth:`compute` through :func:`pallas_kernels.moe.ref.moe_experts` on JAX's CPU device: the
        oracle the kernel is tested against (XLA:CPU decodes whole experts: far slower)."""
        put = functools.partial(jax.device_put, device=self.cpu)
        out = _reference(
            put(x),
            put(slots - self.gpu),
            put(weights),
            self.experts,
            put(np.int32(layer)) if self.stacked else None,
            unique=min(slots.size, self.num),
            swiglu_limit=self.swiglu_limit,
        )
        return np.asarray(out)


@functools.partial(jax.jit, static_argnames=("unique", "swiglu_limit"))
def _reference(x, ids, weights, experts, layer, *, unique: int, swiglu_limit: float | None):
    """The routed experts of ``ids`` (``[0, E)``: this side's; others contribute nothing), float32.
    Only the experts the tokens chose (at most ``unique``) are gathered from the layer's stack."""
    if layer is not None:
        experts = take_layer(experts, layer)
    E = experts["down"].shape[0]
    valid = (ids >= 0) & (ids < E)
    chosen = jnp.unique(jnp.where(valid, ids, E).reshape(-1), size=unique, fill_value=E)  # ascending
    local = jnp.where(valid, jnp.searchsorted(chosen, ids), unique)  # an id's position in ``chosen``
    picked = jax.tree.map(lambda a: jnp.take(a, jnp.minimum(chosen, E - 1), axis=0), experts)
    return moe_experts(x, local, weights, picked, swiglu_limit=swiglu_limit, out_dtype=jnp.float32)
