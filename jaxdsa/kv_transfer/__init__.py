"""Prefill-decode disaggregation between servers: ``--kv-transfer-config`` (:mod:`.config`), each
server's end of it (:mod:`.connector`: images offered and pulled, vLLM's ``kv_transfer_params``) and
the transport (:mod:`.agent`).

A decode server pulls a request's KV bytes out of a prefill server's registered staging buffer with a
one-sided NIXL READ (UCX backend), the way vLLM's NixlConnector does; the prefill side learns that its
buffer is free again from the notification that arrives with the read. What the bytes are, and how
an engine gathers and scatters them, is :mod:`jaxdsa.engine.handoff`.
"""

from jaxdsa.kv_transfer.agent import Region, Transfer, TransferAgent, TransferError

__all__ = ["Region", "Transfer", "TransferAgent", "TransferError"]
