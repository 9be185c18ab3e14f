"""Which routed experts of each MoE layer the GPUs hold, and which live in host RAM.

``--num-gpu-experts N`` keeps N routed experts of every MoE layer on the GPUs (split over them as
the mesh splits experts) and the others in host RAM, computed on the CPU (:mod:`jaxdsa.offload`).
``--gpu-experts-policy`` chooses the N:

- ``uniform``: spread evenly over the expert ids (experts ``floor(i E / N)``), the same in every layer,
  so that every routing group (DeepSeek's group-limited top-k) keeps some on the GPUs;
- ``frequency``: the N most-routed experts of each layer, from routing statistics in a JSON file
  (``--expert-stats``): ``{"layers": {"<experts prefix>": [count of expert 0, 1, ...]}}``, keyed by
  the experts' tensor prefix in the checkpoint (``model.layers.3.mlp.experts``). A layer missing from
  the file falls back to ``uniform``.

Inside the step, routing ids map to slots (:func:`slot_table`): a GPU expert's position in the GPU
stack (``0 .. N - 1``), a host expert ``N`` plus its position in the host stack. The GPU kernels drop
slots past their own range, so the same ids drive both sides.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np

POLICIES = ("uniform", "frequency")


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """``num_gpu_experts`` routed experts per MoE layer on the GPUs, chosen by ``policy``; ``stats``:
    routing counts per experts prefix (the ``frequency`` policy's input); ``cpu_threads``: the host
    side's kernel threads. Half the cores by default: on a 64-core Sapphire Rapids host 32 threads
    ran one token's INT4 experts in 11 ms, 64 in 26 (``benchmarks/results/host_experts-h100-glm52.md``)."""

    num_gpu_experts: int
    policy: str = "uniform"
    stats: Mapping[str, Sequence[float]] = dataclasses.field(default_factory=dict)
    cpu_threads: int = dataclasses.field(default_factory=lambda: max(1, (os.cpu_count() or 2) // 2))

    def __post_init__(self):
        if self.num_gpu_experts < 0:
            raise ValueError(f"num_gpu_experts {self.num_gpu_experts}: must be 0 or more")
        if self.policy not in POLICIES:
            raise ValueError(f"gpu_experts_policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if self.policy == "frequency" and not self.stats:
            raise ValueError("gpu_experts_policy 'frequency' needs routing statistics (expert_stats=FILE)")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads {self.cpu_threads}: must be 1 or more")

    @classmethod
    def of(
        cls,
        num_gpu_experts: int | None,
        policy: str = "uniform",
        stats_path: str | os.PathLike | None = None,
        cpu_threads: int | None = None,
    ) -> ExpertPlacement | None:
        """The placement the user's arguments ask for; None (every expert on the GPUs) without
        ``num_gpu_experts``."""
        if num_gpu_experts is None:
            if stats_path is not None or policy != "uniform" or cpu_threads is not None:
                raise ValueError("gpu_experts_policy, expert_stats and cpu_threads need num_gpu_experts")
            return None
        stats = load_stats(stats_path) if stats_path is not None else {}
        threads = {} if cpu_threads is None else {"cpu_threads": cpu_threads}
        return cls(num_gpu_experts, policy, stats, **threads)

    def gpu_experts(self, prefix: str, num: int) -> tuple[int, ...]:
        """The experts (ids, ascending) of the layer whose experts are stored under ``prefix`` that the
        GPUs hold, out of ``num``."""
        n = min(self.num_gpu_experts, num)
        counts = self.stats.get(prefix) if self.policy == "frequency" else None
        if counts is None:
            return tuple(i * num // n for i in range(n))
        if len(counts) != num:
            raise ValueError(f"expert stats for {prefix}: {len(counts)} counts for {num} experts")
        order = np.argsort(-np.asarray(counts, np.float64), kind="stable")  # ties: the lower id
        return tuple(sorted(int(e) for e in order[:n]))

    def host_experts(self, prefix: str, num: int) -> tuple[int, ...]:
        """The layer's other experts (ascending): the ones host RAM holds."""
        gpu = set(self.gpu_experts(prefix, num))
        return tuple(e for e in range(num) if e not in gpu)


def slot_table(gpu: Sequence[int], host: Sequence[int]) -> np.ndarray:
    """int32 [E]: each expert's slot, its position among ``gpu``, or ``len(gpu)`` plus its position
    among ``host``."""
    table = np.empty(len(gpu) + len(host), np.int32)
    table[list(gpu)] = np.arange(len(gpu))
    table[list(host)] = len(gpu) + np.arange(len(host))
    return table


def load_stats(path: str | os.PathLike) -> dict[str, list[float]]:
    """Routing counts per experts prefix from a JSON stats file (format in the module docstring)."""
    try:
        with open(path, encoding="utf-8") as fh:
            layers = json.load(fh)["layers"]
        return {str(k): [float(c) for c in v] for k, v in layers.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"expert stats {os.fspath(path)}: not a routing statistics file "
            f'({{"layers": {{"<experts prefix>": [counts]}}}}): {e}'
        ) from None
