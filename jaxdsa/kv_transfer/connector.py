"""One server's end of disaggregated serving: cache images offered to decode servers, pulled from
prefill servers, moved by NIXL (:mod:`.agent`).

The protocol is vLLM's ``kv_transfer_params`` (what its disaggregated proxy relays): a prefill
server answers a ``do_remote_decode`` request with the params a decode server needs to pull the
request's cache, and the decode server is sent the same request with those params
(``do_remote_prefill``). The decode side pulls (a one-sided READ, as vLLM's NixlConnector does):
it starts once it holds pages for the request, so a decode server short of pages delays the read
instead of receiving bytes it has no room for.

What moves is the request's :class:`~jaxdsa.engine.handoff.CacheImage`, a host buffer the prefill
engine gathered from its cache (any mesh) and the decode engine scatters into its own (any mesh):
registered with NIXL on both sides, read in one transfer. The prefill side keeps its buffer until
the decode side's notification says it was read, or for ``lease_s``; a decode server that has not
started reading by then fails the request rather than read a buffer that may be gone.

The params carry the prefill agent's NIXL metadata as it is once the image is registered (a NIXL
peer can only read regions its copy of the metadata lists, and each image is registered on its
own), so no side channel or NIXL listener (which would bind every interface) is needed. Registering
one staging pool per server at start-up, as vLLM registers its KV cache once, would let peers
exchange metadata once; on a GPU the cache itself could be registered and read without staging.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from jaxdsa.engine.handoff import CacheImage, ImageLayout
from jaxdsa.engine.request import TokenLogprobs
from jaxdsa.kv_transfer.agent import Region, Transfer, TransferAgent, TransferError
from jaxdsa.kv_transfer.config import KVTransferConfig

log = logging.getLogger(__name__)

POLL_S = 0.005  # how often the prefill side reads its notifications


@dataclasses.dataclass
class _Offer:
    region: Region
    data: np.ndarray  # the registered buffer (kept alive while offered)
    expires: float  # time.time() after which it is released unread


@dataclasses.dataclass
class TransferStats:
    """Counters for ``/metrics``."""

    offered: int = 0
    offered_bytes: int = 0
    expired: int = 0  # offers released because no decode server read them in time
    received: int = 0
    received_bytes: int = 0
    receive_seconds: float = 0.0
    failed: int = 0

    def as_metrics(self) -> dict[str, float]:
        """The counters under the names ``/metrics`` reads (``kv_transfer_*``)."""
        return {f"kv_transfer_{k}": float(v) for k, v in dataclasses.asdict(self).items()}


class KVConnector:
    """A server's NIXL agent with its offers (prefill side) and its peers (decode side)."""

    def __init__(self, config: KVTransferConfig):
        self.config = config
        self.stats = TransferStats()
        self._lock = threading.Lock()  # NIXL calls come from the engine, HTTP and polling threads
        self._agent = TransferAgent(f"jaxdsa-{config.engine_id}-{os.getpid()}")
        self._offers: dict[str, _Offer] = {}
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="kv-transfer", daemon=True)
        self._poller.start()

    # -- prefill side --------------------------------------------------------------------------
    def offer(self, image: CacheImage) -> dict[str, Any]:
        """Register an exported request's image for a decode server to read; the
        ``kv_transfer_params`` the prefill response carries."""
        transfer_id = uuid.uuid4().hex
        expires = time.time() + self.config.lease_s
        with self._lock:
            region = self._agent.register(image.data)
            self._offers[transfer_id] = _Offer(region, image.data, expires)
            metadata = self._agent.metadata()
        self.stats.offered += 1
        self.stats.offered_bytes += image.data.nbytes
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_agent_metadata": base64.b64encode(metadata).decode(),
            "remote_transfer_id": transfer_id,
            "remote_region": region.to_json(),
            "image_layout": image.layout.to_json(),
            "first_token": image.first_token,
            "first_logprobs": _logprobs_json(image.first_logprobs),
            "lease_expires": expires,
            "transfer_bytes": image.data.nbytes,
        }

    def _poll(self) -> None:
        """Release offers that were read (the reader's notification) or whose lease ran out; a
        failing NIXL call is logged and tried again, so offers are never kept for good."""
        while not self._stop.wait(POLL_S):
            try:
                self._release_offers()
            except TransferError:
                log.exception("releasing offered caches failed; trying again")

    def _release_offers(self) -> None:
        with self._lock:
            for _, message in self._agent.notifications():
                offer = self._offers.pop(message.decode(errors="replace"), None)
                if offer is not None:
                    self._agent.deregister(offer.region)
            now = time.time()
            for transfer_id in [t for t, o in self._offers.items() if o.expires < now]:
                self._agent.deregister(self._offers.pop(transfer_id).region)
                self.stats.expired += 1
                log.warning(
                    "transfer %s: no decode server read it in %.0f s; released",
                    transfer_id,
                    self.config.lease_s,
                )

    # -- decode side ---------------------------------------------------------------------------
    def source(self, params: dict[str, Any]) -> IncomingImage:
        """The image source of a ``do_remote_prefill`` request; ValueError for params that do not
        describe an image, TransferError for one whose lease ran out or whose agent cannot be added."""
        try:
            metadata = base64.b64decode(params["remote_agent_metadata"], validate=True)
            transfer_id = str(params["remote_transfer_id"])
            remote = Region.from_json(params["remote_region"])
            layout = ImageLayout.from_json(params["image_layout"])
            first_token = int(params["first_token"])
            first_logprobs = _logprobs_from_json(params.get("first_logprobs"))
            expires = float(params["lease_expires"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"kv_transfer_params do not describe a prefilled request's cache: {e!r}"
            ) from None
        if time.time() > expires:
            raise TransferError("the prefill server's lease on this request's cache has run out")
        if remote.nbytes != layout.nbytes:
            raise ValueError(
                f"kv_transfer_params: a {remote.nbytes}-byte region for a {layout.nbytes}-byte image"
            )
        try:
            with self._lock:
                peer = self._agent.connect(metadata)
        except TransferError as e:
            self.stats.failed += 1
            raise TransferError(f"the prefill server's NIXL agent cannot be reached: {e}") from e
        return IncomingImage(self, peer, transfer_id, remote, layout, first_token, first_logprobs, expires)

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=1)
        with self._lock:
            self._agent.close()


@dataclasses.dataclass
class IncomingImage:
    """A prefilled request's image on its way (an :class:`~jaxdsa.engine.handoff.ImageSource`):
    the engine starts the read once it holds the request's pages and polls it from its steps."""

    connector: KVConnector
    peer: str
    transfer_id: str
    remote: Region
    layout: ImageLayout
    first_token: int
    first_logprobs: TokenLogprobs | None
    expires: float
    _buffer: np.ndarray | None = None
    _region: Region | None = None
    _transfer: Transfer | None = None
    _started: float = 0.0

    def start(self) -> None:
        if time.time() > self.expires:
            raise TransferError(
                "the prefill server's lease on this request's cache ran out before it was read"
            )
        self._buffer = np.empty(self.layout.nbytes, np.uint8)
        self._started = time.perf_counter()
        c = self.connector
        with c._lock:
            self._region = c._agent.register(self._buffer)
            self._transfer = c._agent.read(
                self.peer,
                self._region,
                self.remote,
                self.transfer_id.encode(),
                timeout_s=c.config.transfer_timeout_s,
            )

    def poll(self) -> CacheImage | None:
        c = self.connector
        try:
            with c._lock:
                done = self._transfer.poll()
        except TransferError:
            c.stats.failed += 1
            self._release()
            raise
        if not done:
            return None
        self._release()
        c.stats.received += 1
        c.stats.received_bytes += self.layout.nbytes
        c.stats.receive_seconds += time.perf_counter() - self._started
        return CacheImage(self.layout, self.first_token, self._buffer, self.first_logprobs)

    def cancel(self) -> None:
        with self.connector._lock:
            if self._transfer is not None:
                self._transfer.cancel()
        self._release()

    def _release(self) -> None:
        with self.connector._lock:
            if self._region is not None:
                self.connector._agent.deregister(self._region)
                self._region = None


def _logprobs_json(lp: TokenLogprobs | None) -> list | None:
    return None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


def _logprobs_from_json(value: Any) -> TokenLogprobs | None:
    if value is None:
        return None
    token_id, logprob, top = value
    return TokenLogprobs(int(token_id), float(logprob), tuple((int(t), float(p)) for t, p in top))
