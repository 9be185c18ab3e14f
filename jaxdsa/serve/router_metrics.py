"""The router's ``GET /metrics`` (Prometheus, names under ``jaxdsa_router_``), one registry per app
so that several routers can live in one process (tests).

``outcome`` of a request: ``ok`` (2xx), ``client_error`` (4xx, the router's own or relayed),
``error`` (5xx, or a stream its upstream broke), ``cancelled`` (the client left a stream).
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxdsa.serve.metrics import LATENCY_BUCKETS

ROLES = ("prefill", "decode")


def outcome(status: int) -> str:
    """A response status's ``outcome`` label."""
    return "ok" if status < 400 else "client_error" if status < 500 else "error"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "jaxdsa_router_requests",
            "Requests answered, by route and outcome.",
            ["route", "outcome"],
            registry=self.registry,
        )
        self.upstream_failures = Counter(
            "jaxdsa_router_upstream_failures",
            "Upstream requests that failed: unreachable, timed out, a 5xx, a broken stream, or a"
            " prefill answer without kv_transfer_params.",
            ["role"],
            registry=self.registry,
        )
        for role in ROLES:  # zero from the start, so a rate() sees the first failure
            self.upstream_failures.labels(role)
        self.in_flight = Gauge(
            "jaxdsa_router_requests_in_flight",
            "Requests being routed (a stream until its last byte).",
            registry=self.registry,
        )
        self.prefill_latency = Histogram(
            "jaxdsa_router_prefill_latency_seconds",
            "Time of the prefill request, sent to its answer.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.kv_transfer_bytes = Counter(
            "jaxdsa_router_kv_transfer_bytes",
            "KV cache bytes moved from prefill to decode, as the prefill's kv_transfer_params report"
            " them (transfer_bytes).",
            registry=self.registry,
        )
        self.kv_transfer_seconds = Counter(
            "jaxdsa_router_kv_transfer_seconds",
            "Time spent moving KV caches, as the prefill's kv_transfer_params report it (transfer_seconds).",
            registry=self.registry,
        )

    def observe_transfer(self, kv_transfer_params: dict[str, Any]) -> None:
        """Count the transfer a prefill reports; fields that are absent or not a finite number >= 0
        are skipped (the servers need not report them)."""
        for key, counter in (
            ("transfer_bytes", self.kv_transfer_bytes),
            ("transfer_seconds", self.kv_transfer_seconds),
        ):
            value = kv_transfer_params.get(key)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if number and math.isfinite(value) and value >= 0:
                counter.inc(value)

    def track(self, route: str) -> Tracked:
        """Count a request in flight on ``route`` until :meth:`Tracked.done` gives its outcome."""
        return Tracked(self, route)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Tracked:
    """One request's place in the in-flight gauge and its outcome, counted once however it ends."""

    def __init__(self, metrics: RouterMetrics, route: str):
        self.metrics, self.route, self.finished = metrics, route, False
        metrics.in_flight.inc()

    def done(self, outcome: str) -> None:
        if not self.finished:
            self.finished = True
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(self.route, outcome).inc()
