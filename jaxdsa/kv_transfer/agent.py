"""One NIXL agent per server process (UCX backend), to pull whole KV staging buffers with one-sided READs.

NIXL 1.5.1's pitfalls, found on the 2-core CPU box, and what this module does about them:

* NIXL has no transfer timeout: a READ from a hung (SIGSTOPped) peer stays in progress forever. Every
  :class:`Transfer` carries our own deadline and releases its handle when it passes (releasing an in-flight
  handle is how NIXL cancels).
* ``add_remote_agent()`` returns the peer's name as bytes, while notifications are keyed by str.
* The progress thread busy-polls a core (see ``_PROGRESS_DELAY_US``); UCX needs two env defaults
  (``UCX_ENV_DEFAULTS``).
* NIXL's own metadata listener binds 0.0.0.0, so it is not used: :meth:`TransferAgent.metadata` and
  :class:`Region` go over the servers' own side channel.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, NoReturn

import numpy as np

# For P/D on one host, the only deployment checked so far. Set with setdefault, so an operator's values win;
# a multi-node deployment passes env_defaults=False (or sets its own) to reach other hosts over TCP or IB.
UCX_ENV_DEFAULTS = {
    # Without it UCX also opened TCP lanes on eth0 next to lo.
    "UCX_NET_DEVICES": "lo",
    # Once UCX has loaded its InfiniBand module, the wheel's bundled libnl-route segfaults in its ELF
    # destructor at process exit; without the module, transfers are unchanged and exit is clean.
    "UCX_MODULES": "^ib",
}

# Timeout (us) of the poll() in which the UCX backend's progress thread waits on its workers' event fds.
# Events wake the thread at once; the timeout only backstops a UCX wakeup bug (nixl's ucx_backend.cpp).
# nixl's Python wrapper hard-codes 0, which turns the wait into a busy loop. Measured on the 2-core CPU box,
# a 4 MiB READ between registered numpy buffers of two processes, default UCX_TLS:
# * no thread (enable_prog_thread=False): a READ progresses only while the *target* process is inside a NIXL
#   call. From a producer that made none it stayed in progress for 8 s, 5 tries of 5; with the producer
#   polling every 10 ms it took ~10 ms. A prefill server busy in a long step would stall every pull.
# * 0 (nixl's default): one idle agent burns 2.35 s of CPU per 3 s; with two on the box, reads take 2-29 ms.
# * 1 ms: 0.05 s of CPU per idle 3 s; reads 0.4-0.8 ms (5 ms with UCX_TLS=tcp).
# * 10 ms: 0.01 s per idle 3 s; reads 0.4-0.9 ms (8 ms with UCX_TLS=tcp). 100 ms gains nothing more.
_PROGRESS_DELAY_US = 10_000

_NIXL_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")
_config_class_lock = threading.Lock()


class TransferError(RuntimeError):
    """A NIXL call failed, a transfer reported an error, or its deadline passed; the message names the agent,
    the peer and the operation."""


@dataclasses.dataclass(frozen=True)
class Region:
    """A registered memory region: what a peer needs to name it in a READ descriptor (NIXL's address, length,
    device id and memory type). Plain ints and a str, so that it crosses the side channel as JSON."""

    address: int
    nbytes: int
    device: int = 0
    kind: str = "DRAM"

    def __post_init__(self) -> None:
        # Regions arrive from other processes: refuse what NIXL would turn into a KeyError or bad descriptor.
        if self.kind not in ("DRAM", "VRAM") or min(self.address, self.nbytes, self.device) < 0:
            raise ValueError(f"invalid region {self}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Region:
        return cls(int(d["address"]), int(d["nbytes"]), int(d.get("device", 0)), str(d.get("kind", "DRAM")))


def _import_nixl() -> ModuleType:
    """NIXL's Python API from whichever CUDA flavour of the wheel is installed. The ``nixl`` meta package is
    not required: its 1.5.2 does not resolve, and its 1.5.1 pulls both wheels plus torch."""
    errors = []
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError(
        "jaxdsa.kv_transfer needs NIXL: pip install --no-deps nixl-cu13==1.5.1 (or nixl-cu12==1.5.1 for "
        "CUDA 12; --no-deps because the wheel declares torch). Tried " + "; ".join(errors)
    )


def _checked(what: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    # nixl raises its own nixl*Error classes, and RuntimeError/KeyError from its Python wrapper
    except Exception as e:
        raise TransferError(f"{what} failed: {type(e).__name__}: {e}") from e


def _new_nixl_agent(api: ModuleType, name: str) -> Any:
    """A nixl_agent whose progress thread waits ``_PROGRESS_DELAY_US``, with a UCX backend.

    nixl_agent builds its bindings config itself and then sets pthrDelay=0, so the way in through the wrapper
    is a config class whose pthrDelay setter substitutes ours. The swap is module-wide, hence the lock.
    """
    base = api.nixlBind.nixlAgentConfig
    applied = []

    class _Config(base):
        def __setattr__(self, key: str, value: Any) -> None:
            if key == "pthrDelay":
                value = _PROGRESS_DELAY_US
                applied.append(value)
            super().__setattr__(key, value)

    with _config_class_lock:
        api.nixlBind.nixlAgentConfig = _Config
        try:
            config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[])
            agent = _checked(f"creating NIXL agent {name!r}", lambda: api.nixl_agent(name, config))
        finally:
            api.nixlBind.nixlAgentConfig = base
    if not applied:
        raise TransferError(f"NIXL agent {name!r}: this nixl no longer sets pthrDelay; its thread would spin")
    # Explicitly: with backends=["UCX"], a missing UCX plugin is only a logged warning.
    _checked(f"creating the UCX backend of agent {name!r}", lambda: agent.create_backend("UCX", {}))
    return agent


class TransferAgent:
    """This process's NIXL agent: registers local buffers, connects to peers from their metadata and READs
    their regions. Every NIXL call runs under one lock, so a side-channel thread may serve :meth:`metadata`
    while the engine loop reads."""

    def __init__(self, name: str, *, env_defaults: bool = True) -> None:
        if env_defaults:
            for key, value in UCX_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
        api = _import_nixl()  # after the env defaults: UCX reads them when it loads its modules
        self.name = name
        self._lock = threading.RLock()
        self._nixl: Any = _new_nixl_agent(api, name)
        self._regions: dict[Region, tuple[np.ndarray, Any]] = {}
        self._peers: dict[str, bytes] = {}
        self._transfers: set[Transfer] = set()

    def _live(self) -> Any:
        if self._nixl is None:
            raise TransferError(f"agent {self.name!r} is closed")
        return self._nixl

    def _call(self, what: str, call: Callable[[Any], Any]) -> Any:
        nixl = self._live()
        return _checked(f"agent {self.name!r}: {what}", lambda: call(nixl))

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info and registered regions) for peers' :meth:`connect`.
        Regions registered later are not in it: publish it again, and peers connect() the new bytes."""
        with self._lock:
            return self._call("reading metadata", lambda nixl: nixl.get_agent_metadata())

    def register(self, array: np.ndarray) -> Region:
        """Register a C-contiguous host array (DRAM) and return its Region. The agent keeps a reference until
        :meth:`deregister`, so the memory cannot be freed while a peer may read it or a READ may write it."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.nbytes == 0:
            raise ValueError("register() takes a non-empty C-contiguous numpy array")
        region = Region(array.ctypes.data, array.nbytes)
        desc = np.array([(region.address, region.nbytes, region.device)], np.uint64)
        with self._lock:
            if region in self._regions:
                raise ValueError(f"{region} is already registered")
            reg = self._call(f"registering {region}", lambda nixl: nixl.register_memory(desc, "DRAM"))
            self._regions[region] = (array, reg)
        return region

    def deregister(self, region: Region) -> None:
        """Unregister a region and drop the agent's reference to its array; peers' READs of it now fail."""
        with self._lock:
            if region not in self._regions:
                raise ValueError(f"{region} is not registered with agent {self.name!r}")
            reg = self._regions[region][1]
            self._call(f"deregistering {region}", lambda nixl: nixl.deregister_memory(reg))
            del self._regions[region]

    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's metadata so that this agent can READ its regions; returns the peer's name. Loading
        the same bytes again is a no-op and newer metadata of the same live peer updates it, but NIXL refuses
        a restarted peer under a connected name until :meth:`disconnect`."""
        with self._lock:
            for name, metadata in self._peers.items():
                if metadata == peer_metadata:
                    return name
            what = "loading peer metadata (a peer restarted under a connected name needs disconnect() first)"
            name = self._call(what, lambda nixl: nixl.add_remote_agent(peer_metadata))
            name = name.decode() if isinstance(name, bytes) else name  # nixl 1.5.1 returns bytes
            self._peers[name] = peer_metadata
            return name

    def disconnect(self, peer: str) -> None:
        """Cancel the transfers from ``peer`` and forget it (NIXL closes the connection). An unknown peer is
        ignored, so that cleanup paths may call it twice."""
        with self._lock:
            if peer not in self._peers:
                return
            for transfer in [t for t in self._transfers if t.peer == peer]:
                transfer.cancel()
            self._call(f"disconnecting from {peer!r}", lambda nixl: nixl.remove_remote_agent(peer))
            del self._peers[peer]

    def read(
        self, peer: str, local: Region, remote: Region, notification: bytes, *, timeout_s: float
    ) -> Transfer:
        """Start a one-sided READ of the peer's ``remote`` region into ``local`` and return at once. The peer
        receives ``notification`` (see :meth:`notifications`) once the data has been read, i.e. when it may
        reuse its buffer. ``timeout_s`` bounds the whole transfer, since NIXL has no timeout of its own."""
        if local.nbytes != remote.nbytes:
            raise ValueError(f"READ size mismatch: local {local.nbytes} B, remote {remote.nbytes} B")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        with self._lock:
            if local not in self._regions:
                raise ValueError(f"{local} is not registered with agent {self.name!r}")
            if peer not in self._peers:
                raise TransferError(f"agent {self.name!r}: peer {peer!r} is not connected")
            what = f"READ of {remote.nbytes} B from {peer!r}"

            def create(nixl: Any) -> Any:  # one descriptor per side: transfers are whole staging buffers
                descs = [
                    nixl.get_xfer_descs(np.array([(r.address, r.nbytes, r.device)], np.uint64), r.kind)
                    for r in (local, remote)
                ]
                return nixl.initialize_xfer("READ", descs[0], descs[1], peer, notification)

            handle = self._call(f"creating the {what}", create)
            transfer = Transfer(self, handle, peer, what, timeout_s)
            self._transfers.add(transfer)
            transfer._advance("posting", lambda nixl: nixl.transfer(handle))
        return transfer

    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer name, message) for each notification received since the last call. A prefill server calls it
        from its loop to learn which buffers were read; the reader need not be connected to it."""
        with self._lock:
            notifs = self._call("fetching notifications", lambda nixl: nixl.get_new_notifs())
        return [(peer, message) for peer, messages in notifs.items() for message in messages]

    def close(self) -> None:
        """Cancel transfers, disconnect peers, deregister regions and destroy the NIXL agent (which stops its
        progress thread). Idempotent. If a step fails, NIXL's destructor does the rest and the error is
        raised."""
        with self._lock:
            if self._nixl is None:
                return
            try:
                for transfer in list(self._transfers):
                    transfer.cancel()
                for peer in list(self._peers):
                    self.disconnect(peer)
                for region in list(self._regions):
                    self.deregister(region)
            finally:
                self._transfers.clear()
                self._peers.clear()
                self._regions.clear()
                self._nixl = None  # the last reference to the nixl_agent

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transfer:
    """One READ in flight. Holds the NIXL handle until the transfer is done, failed, timed out or cancelled,
    then releases it; after that the local region is no longer written."""

    def __init__(self, agent: TransferAgent, handle: Any, peer: str, what: str, timeout_s: float) -> None:
        self.peer = peer
        self._agent = agent
        self._handle = handle
        self._what = what
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._error: TransferError | None = None

    def poll(self) -> bool:
        """True once the data has arrived. Raises TransferError if NIXL reports an error or the deadline
        passed (the handle is then released), and again on every later call."""
        with self._agent._lock:
            return self._advance("checking", lambda nixl: nixl.check_xfer_state(self._handle))

    def wait(self) -> None:
        """Poll until done. The progress thread moves the data; this only watches, with 1 ms sleeps."""
        while not self.poll():
            time.sleep(0.001)

    def cancel(self) -> None:
        """Release the transfer without waiting (NIXL cancels it); later polls raise. Idempotent, and a no-op
        once the transfer is done."""
        with self._agent._lock:
            if self._handle is not None:
                self._error = TransferError(f"agent {self._agent.name!r}: {self._what}: cancelled")
                self._release()

    def _advance(self, step: str, call: Callable[[Any], str]) -> bool:
        """Run one NIXL state call (post or check) and act on its "DONE" / "PROC" / "ERR"."""
        if self._error is not None:
            raise self._error
        if self._handle is None:
            return True
        nixl = self._agent._live()
        try:
            state = call(nixl)
        except Exception as e:  # as in _checked
            self._fail(f"{step} failed: {type(e).__name__}: {e}", e)
        if state == "DONE":
            self._release()
            return True
        if state != "PROC":
            self._fail(f"{step}: NIXL reports {state}")
        if time.monotonic() > self._deadline:
            self._fail(f"not done after {self._timeout_s:g} s (peer hung?); cancelled")
        return False

    def _fail(self, reason: str, cause: Exception | None = None) -> NoReturn:
        try:
            self._release()
        except TransferError as e:
            reason += f"; {e} (the local region may still be written)"
        self._error = TransferError(f"agent {self._agent.name!r}: {self._what}: {reason}")
        raise self._error from cause

    def _release(self) -> None:
        handle, self._handle = self._handle, None
        self._agent._transfers.discard(self)
        self._agent._call(f"releasing the {self._what}", lambda nixl: nixl.release_xfer_handle(handle))
