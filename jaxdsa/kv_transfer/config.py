"""``--kv-transfer-config``: vLLM's JSON for prefill-decode disaggregation, checked at start-up.

The keys are vLLM's (``KVTransferConfig``); those that choose something jaxdsa does not do are
refused with the reason, unknown keys too, so that a deployment guide's command line either
works as written or says which key to change.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Connector names deployment guides use; every one of them moves the cache with NIXL here (both
# sides must be jaxdsa servers, so the name only ever chose the transfer engine)
CONNECTORS = ("NixlConnector", "MooncakeConnectorV1", "MooncakeConnector")
# vLLM keys that carry no choice for jaxdsa (buffers and ranks are per engine here)
_ACCEPTED = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port")
_EXTRA = {"transfer_timeout_s": 30.0, "lease_s": 120.0}


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """A server's part in disaggregated serving. ``transfer_timeout_s``: how long a decode server
    waits for one request's cache before failing it; ``lease_s``: how long a prefill server keeps a
    request's cache for the decode server to read."""

    kv_connector: str
    kv_role: str
    engine_id: str
    transfer_timeout_s: float = 30.0
    lease_s: float = 120.0

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, text: str) -> KVTransferConfig:
        """The config a ``--kv-transfer-config`` JSON string gives; ValueError saying what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("must be a JSON object")
        raw = dict(raw)
        connector = raw.pop("kv_connector", None)
        if connector not in CONNECTORS:
            raise ValueError(f"kv_connector {connector!r}: choose one of {', '.join(CONNECTORS)}")
        role = raw.pop("kv_role", None)
        if role not in ROLES:
            raise ValueError(f"kv_role {role!r}: choose one of {', '.join(ROLES)}")
        engine_id = str(raw.pop("engine_id", None) or uuid.uuid4().hex)
        policy = raw.pop("kv_load_failure_policy", "fail")
        if policy != "fail":
            raise ValueError(
                f"kv_load_failure_policy {policy!r}: only 'fail' (a request whose cache "
                "does not arrive fails; it is not recomputed on the decode side)"
            )
        module = raw.pop("kv_connector_module_path", None)
        if module:
            raise ValueError("kv_connector_module_path: connectors from other modules are not loaded")
        extra = _extra(raw.pop("kv_connector_extra_config", None) or {})
        for key in _ACCEPTED:
            raw.pop(key, None)
        if raw:
            raise ValueError(f"unknown key(s) {', '.join(sorted(raw))}")
        return cls(connector, role, engine_id, **extra)


def _extra(extra: Any) -> dict[str, Any]:
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    unknown = sorted(set(extra) - set(_EXTRA))
    if unknown:
        raise ValueError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(_EXTRA)})"
        )
    out = {}
    for key in ("transfer_timeout_s", "lease_s"):
        if key in extra:
            value = extra[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be a number > 0")
            out[key] = float(value)
    return out
