"""The router's upstream instances: round-robin over the healthy ones of each role, and the health
poll that takes an instance out of the rotation and puts it back.

An instance starts healthy (the router may start before its servers are ready; the first poll or
the first failed connection says otherwise). One that refuses a connection is marked unhealthy at
once, so the requests behind it go elsewhere without waiting for the next poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import httpx

from jaxdsa.serve.errors import ApiError

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0  # a server slower than this to answer /health is as good as down


@dataclasses.dataclass
class Instance:
    url: str  # base URL, without a trailing slash
    healthy: bool = True


class Pool:
    """The instances of one role (``prefill`` or ``decode``), taken in turn."""

    def __init__(self, role: str, urls: list[str]):
        if not urls:
            raise ValueError(f"no {role} instance")
        self.role = role
        self.instances = [Instance(url.rstrip("/")) for url in urls]
        self._next = 0

    def pick(self) -> Instance:
        """The next healthy instance after the last one picked; 503 when none is healthy."""
        n = len(self.instances)
        for k in range(n):
            instance = self.instances[(self._next + k) % n]
            if instance.healthy:
                self._next = (self._next + k + 1) % n
                return instance
        raise ApiError(503, f"no healthy {self.role} instance (down: {', '.join(self.down())})", code=503)

    def down(self) -> list[str]:
        return [i.url for i in self.instances if not i.healthy]

    def mark(self, instance: Instance, healthy: bool, why: str = "") -> None:
        """Set an instance's health, logging the changes only."""
        if instance.healthy != healthy:
            state = "healthy" if healthy else f"unhealthy ({why})" if why else "unhealthy"
            log.warning("%s instance %s is %s", self.role, instance.url, state)
        instance.healthy = healthy


async def poll_health(client: httpx.AsyncClient, pools: list[Pool]) -> None:
    """Ask every instance's ``GET /health`` at once; 200 in time is healthy, anything else is not."""

    async def check(pool: Pool, instance: Instance) -> None:
        try:
            r = await client.get(f"{instance.url}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as e:
            pool.mark(instance, False, f"/health: {type(e).__name__}")
        else:
            pool.mark(instance, r.status_code == 200, f"/health answered {r.status_code}")

    await asyncio.gather(*(check(pool, i) for pool in pools for i in pool.instances))


async def poll_forever(client: httpx.AsyncClient, pools: list[Pool], interval: float) -> None:
    """:func:`poll_health` now and every ``interval`` seconds, until cancelled."""
    while True:
        await poll_health(client, pools)
        await asyncio.sleep(interval)
