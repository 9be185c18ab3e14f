"""CPU/GPU hybrid MoE: routed experts that do not fit the GPUs live in host RAM and run on the CPU.

:mod:`~jaxdsa.offload.placement` says which experts stay on the GPUs, :mod:`~jaxdsa.offload.split`
cuts the model and its specs at load, :mod:`~jaxdsa.offload.host_experts` computes the host side
inside the step, :mod:`~jaxdsa.offload.stats` records the routing counts the ``frequency``
placement reads.
"""

from jaxdsa.offload.placement import POLICIES, ExpertPlacement
from jaxdsa.offload.split import HostPlan, attach, plan

__all__ = ["POLICIES", "ExpertPlacement", "HostPlan", "attach", "plan"]
