"""Routing statistics recorded while serving: the input of ``--gpu-experts-policy frequency``.

``--record-expert-stats FILE`` (``LLM(..., record_expert_stats=FILE)``) counts, per MoE layer, how
many of the step's real tokens each routed expert received, and writes them in the format
``--expert-stats`` reads (:mod:`jaxdsa.offload.placement`): ``{"layers": {"<experts prefix>": [count
of expert 0, 1, ...]}}``, keyed by the experts' tensor prefix in the checkpoint. A later server
started with ``--num-gpu-experts N --gpu-experts-policy frequency --expert-stats FILE`` keeps each
layer's N most-used experts on the GPUs.

Each MoE layer hands its routing ids to the host through a debug callback, run by one device of the
mesh (the ids are the same on every device that holds them): recording costs a host round trip per
layer and splits the step's CUDA graphs, so it is a mode for a profiling run, not for production.
The file is written when the engine closes, and by :meth:`ExpertStats.write` at any time.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdsa import sharding
from jaxdsa.checkpoints.spec import Stacked
from jaxdsa.layers.mlp import Experts


class ExpertStats:
    """Routing counts per experts prefix, gathered from every recorded layer, for ``path``."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.counts: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def add(self, prefix: str, counts: np.ndarray) -> None:
        with self._lock:
            if prefix in self.counts:
                self.counts[prefix] += counts
            else:
                self.counts[prefix] = counts.astype(np.int64)

    def write(self) -> pathlib.Path:
        """Write the counts so far (atomically: a reader never sees half a file)."""
        with self._lock:
            layers = {prefix: counts.tolist() for prefix, counts in sorted(self.counts.items())}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"layers": layers}) + "\n", encoding="utf-8")
        tmp.replace(self.path)
        return self.path


class ExpertRecorder:
    """One Experts module's recording: its layers' experts prefixes (one per layer of a scanned
    stack) and how many routed experts each has. Compared by identity: static data of the module
    tree, as :class:`~jaxdsa.offload.host_experts.HostExperts` is."""

    def __init__(self, stats: ExpertStats, prefixes: list[str], experts: int):
        self.stats, self.prefixes, self.experts = stats, prefixes, experts

    def record(self, ids: jax.Array, valid: jax.Array | None, layer: jax.Array | None) -> None:
        """Count ``ids [T, k]`` of the real tokens (``valid [T]``; None: all) for ``layer`` (the
        scanned stack's index; None: not stacked), on the host, from the first device of the mesh."""
        valid = jnp.ones(ids.shape[:1], bool) if valid is None else valid
        layer = jnp.zeros((), jnp.int32) if layer is None else layer

        def local(ids, valid, layer, first):
            jax.debug.callback(self._count, ids, valid, layer, first)
            return jnp.zeros((), jnp.int32)

        sharding.on_every_device(local, (ids, valid, layer), sharding.mesh_axis_names())

    def _count(self, ids, valid, layer, first) -> None:
        if not first:
            return
        chosen = np.asarray(ids)[np.asarray(valid)].ravel()
        chosen = chosen[(chosen >= 0) & (chosen < self.experts)]
        self.stats.add(self.prefixes[int(layer)], np.bincount(chosen, minlength=self.experts))


def attach_recorders(model, specs: dict, stats: ExpertStats) -> int:
    """Give every Experts module of ``model`` a recorder into ``stats``, its layers' prefixes read
    from the checkpoint ``specs``; -> how many modules record."""
    modules = 0
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, Experts):
            continue
        spec = specs[(*path, "gate_up")]
        layers = spec.items if isinstance(spec, Stacked) else (spec,)
        node.recorder = ExpertRecorder(stats, [s.prefix for s in layers], layers[0].num)
        modules += 1
    return modules
