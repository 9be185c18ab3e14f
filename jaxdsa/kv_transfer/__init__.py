"""KV-cache transport for prefill-decode disaggregation.

A decode server pulls a request's KV bytes out of a prefill server's registered staging buffer with a
one-sided NIXL READ (UCX backend), the way vLLM's NixlConnector does; the prefill side learns that its
buffer is free again from the notification that arrives with the read. Only the transport lives here:
the metadata and :class:`Region` descriptions travel over the servers' own side channel.
"""

from jaxdsa.kv_transfer.agent import Region, Transfer, TransferAgent, TransferError

__all__ = ["Region", "Transfer", "TransferAgent", "TransferError"]
