"""jaxdsa.kv_transfer over real NIXL between two processes on loopback.

The consumer (decode side) is the test process. Each producer (prefill side) is a "spawn" child that registers
random buffers and hands its metadata and Region JSON over a multiprocessing Pipe, which stands in for the
servers' side channel. The fixture kills every child in its teardown, so a failing test leaves none behind.
"""

import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from jaxdsa.kv_transfer import Region, TransferAgent, TransferError
from jaxdsa.kv_transfer.agent import UCX_ENV_DEFAULTS

MIB = 1 << 20
SPAWN = multiprocessing.get_context("spawn")


def _pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8).copy()


def _producer_main(conn, name: str, sizes: list[int], seed: int) -> None:
    """Child: register a random buffer per size, send (metadata, regions), then answer each "notifications"
    request with everything received so far, until "stop"."""
    with TransferAgent(name) as agent:
        regions = [agent.register(_pattern(seed + i, n)) for i, n in enumerate(sizes)]
        conn.send((agent.metadata(), [r.to_json() for r in regions]))
        received: list[tuple[str, bytes]] = []
        while True:
            received += agent.notifications()
            if conn.poll(0.01):
                if conn.recv() == "stop":
                    break
                conn.send(received)


class Producer:
    def __init__(self, name: str, sizes: list[int], seed: int) -> None:
        self.seed = seed
        self.conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=_producer_main, args=(child, name, sizes, seed), daemon=True)
        self.process.start()
        child.close()

    def handshake(self) -> None:
        assert self.conn.poll(60), "producer did not start"
        self.metadata, regions = self.conn.recv()
        self.regions = [Region.from_json(json.loads(json.dumps(r))) for r in regions]

    def expected(self, i: int) -> np.ndarray:
        return _pattern(self.seed + i, self.regions[i].nbytes)

    def notifications(self, count: int) -> list[tuple[str, bytes]]:
        """What the producer's agent received, once there are ``count`` (or after 10 s: the test fails)."""
        deadline = time.monotonic() + 10
        while True:
            self.conn.send("notifications")
            assert self.conn.poll(10), "producer does not answer"
            received = self.conn.recv()
            if len(received) >= count or time.monotonic() > deadline:
                return received
            time.sleep(0.02)

    def stop(self) -> None:
        self.conn.send("stop")
        self.process.join(30)
        assert self.process.exitcode == 0


@pytest.fixture
def producers() -> Iterator[Callable[..., Producer]]:
    started: list[Producer] = []

    def start(name: str, sizes: list[int], seed: int) -> Producer:
        producer = Producer(name, sizes, seed)
        started.append(producer)
        producer.handshake()
        return producer

    try:
        yield start
    finally:
        for producer in started:
            if producer.process.is_alive():
                producer.process.kill()  # also ends a SIGSTOPped one
            producer.process.join(10)


@pytest.fixture
def ucx_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's UCX defaults, set through monkeypatch so that the test process's env is restored."""
    for key, value in UCX_ENV_DEFAULTS.items():
        monkeypatch.setenv(key, os.environ.get(key, value))


@pytest.fixture
def consumer(ucx_env: None) -> Iterator[TransferAgent]:
    with TransferAgent(f"consumer-{os.getpid()}") as agent:
        yield agent


def test_region_json_round_trip() -> None:
    region = Region(address=0x7F00_0000_1000, nbytes=4 * MIB, device=1, kind="VRAM")
    assert Region.from_json(json.loads(json.dumps(region.to_json()))) == region
    assert Region.from_json({"address": 4096, "nbytes": 8}) == Region(4096, 8, 0, "DRAM")
    with pytest.raises(ValueError):
        Region.from_json({"address": 4096, "nbytes": 8, "kind": "FILE"})
    with pytest.raises(ValueError):
        Region(-1, 8)


def test_missing_nixl_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl_cu13", "nixl_cu13._api", "nixl_cu12", "nixl_cu12._api", "nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail
    monkeypatch.setenv("UCX_NET_DEVICES", "")  # so that monkeypatch restores it ...
    monkeypatch.delenv("UCX_NET_DEVICES")  # ... after the agent set its default
    monkeypatch.setenv("UCX_MODULES", "^ib,xpmem")
    with pytest.raises(ImportError, match=r"pip install --no-deps nixl-cu13==1\.5\.1"):
        TransferAgent("no-nixl")
    # The defaults went in before the import (UCX reads them when it loads), without overriding an operator's.
    assert os.environ["UCX_NET_DEVICES"] == "lo"
    assert os.environ["UCX_MODULES"] == "^ib,xpmem"


def test_idle_agent_does_not_spin_a_core_and_closes_idempotently(ucx_env: None) -> None:
    agent = TransferAgent(f"idle-{os.getpid()}")
    agent.register(np.zeros(MIB, np.uint8))
    start = time.process_time()
    time.sleep(2.0)
    cpu = time.process_time() - start
    agent.close()
    agent.close()
    # nixl's default pthrDelay=0 costs ~1 s of CPU per second here.
    assert cpu < 0.5, f"{cpu:.2f} s of CPU in 2 s idle: the progress thread is busy-polling"
    with pytest.raises(TransferError, match="closed"):
        agent.metadata()


def test_read_whole_buffer_and_notify(consumer: TransferAgent, producers: Callable[..., Producer]) -> None:
    producer = producers("producer-1", [4 * MIB], seed=1)
    peer = consumer.connect(producer.metadata)
    assert peer == "producer-1"
    assert consumer.connect(producer.metadata) == peer
    dst = np.zeros(4 * MIB, np.uint8)
    local = consumer.register(dst)

    transfer = consumer.read(peer, local, producer.regions[0], b"req-1:done", timeout_s=30)
    transfer.wait()
    assert transfer.poll()
    transfer.cancel()  # a no-op once done
    assert np.array_equal(dst, producer.expected(0))
    assert producer.notifications(1) == [(consumer.name, b"req-1:done")]
    producer.stop()  # closes its agent and exits with 0 (no segfault at exit)


def test_several_reads_and_bad_requests(consumer: TransferAgent, producers: Callable[..., Producer]) -> None:
    sizes = [MIB, 3 * MIB + 123, 64 * 1024]
    producer = producers("producer-2", sizes, seed=10)
    peer = consumer.connect(producer.metadata)
    dsts = [np.zeros(n, np.uint8) for n in sizes]
    regions = [consumer.register(d) for d in dsts]

    transfers = [
        consumer.read(peer, local, remote, f"req-{i}".encode(), timeout_s=30)
        for i, (local, remote) in enumerate(zip(regions, producer.regions))
    ]  # all three in flight together
    for transfer in transfers:
        transfer.wait()
    for i, dst in enumerate(dsts):
        assert np.array_equal(dst, producer.expected(i))
    assert sorted(message for _, message in producer.notifications(3)) == [b"req-0", b"req-1", b"req-2"]

    with pytest.raises(ValueError, match="size mismatch"):
        consumer.read(peer, regions[0], producer.regions[1], b"bad", timeout_s=30)
    with pytest.raises(ValueError, match="not registered"):
        consumer.read(peer, Region(dsts[1].ctypes.data, MIB), producer.regions[0], b"bad", timeout_s=30)
    with pytest.raises(TransferError, match="not connected"):
        consumer.read("nobody", regions[0], producer.regions[0], b"bad", timeout_s=30)
    with pytest.raises(TransferError, match="producer-2.*NOT_FOUND"):  # the peer never registered it
        consumer.read(peer, regions[0], Region(4096, MIB), b"bad", timeout_s=30)
    consumer.deregister(regions[2])
    with pytest.raises(ValueError, match="not registered"):
        consumer.read(peer, regions[2], producer.regions[2], b"bad", timeout_s=30)


def test_hung_producer_times_out(
    consumer: TransferAgent, producers: Callable[..., Producer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A producer with TCP lanes only, so that a READ needs its worker to serve it: over shared memory
    # (CMA) UCX may read a stopped process's pages without it, and the READ completed in one CI run.
    monkeypatch.setenv("UCX_TLS", "tcp")
    producer = producers("producer-3", [4 * MIB], seed=3)
    peer = consumer.connect(producer.metadata)
    local = consumer.register(np.zeros(4 * MIB, np.uint8))
    consumer.read(peer, local, producer.regions[0], b"warm", timeout_s=30).wait()

    os.kill(producer.process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        transfer = consumer.read(peer, local, producer.regions[0], b"hung", timeout_s=2)
        with pytest.raises(TransferError, match="'producer-3': not done after 2 s"):
            transfer.wait()
        assert time.monotonic() - start < 20
        with pytest.raises(TransferError, match="not done"):  # stays failed
            transfer.poll()
        pending = consumer.read(peer, local, producer.regions[0], b"pending", timeout_s=30)
        consumer.disconnect(peer)  # cancels it
        with pytest.raises(TransferError, match="cancelled"):
            pending.poll()
    finally:
        os.kill(producer.process.pid, signal.SIGCONT)


def test_killed_producer_fails_and_consumer_stays_usable(
    consumer: TransferAgent, producers: Callable[..., Producer]
) -> None:
    dead = producers("producer-4", [4 * MIB], seed=4)
    peer = consumer.connect(dead.metadata)
    dst = np.zeros(4 * MIB, np.uint8)
    local = consumer.register(dst)
    consumer.read(peer, local, dead.regions[0], b"warm", timeout_s=30).wait()
    dead.process.kill()
    dead.process.join(10)

    start = time.monotonic()
    with pytest.raises(TransferError, match="producer-4"):
        consumer.read(peer, local, dead.regions[0], b"dead", timeout_s=5).wait()
    assert time.monotonic() - start < 30

    # A restarted producer under the same name: NIXL refuses it until the dead one is disconnected.
    live = producers("producer-4", [4 * MIB], seed=5)
    with pytest.raises(TransferError, match="loading peer metadata"):
        consumer.connect(live.metadata)
    consumer.disconnect(peer)
    assert consumer.connect(live.metadata) == peer
    dst[:] = 0
    consumer.read(peer, local, live.regions[0], b"after", timeout_s=30).wait()
    assert np.array_equal(dst, live.expected(0))
    assert live.notifications(1) == [(consumer.name, b"after")]
