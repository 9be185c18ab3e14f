"""NIXL READs between two processes of this host: what the prefill-decode handoff's transport gives, by
size and UCX setting, without the engines.

A producer process (the prefill side) registers a host buffer and idles; this process (the decode side)
connects, registers its own buffer and READs the producer's whole buffer ``--repeats`` times per size,
polling as fast as it can; then as the servers do today, a new producer buffer (and so new metadata to
load) for every READ. Each UCX setting runs in a fresh pair of processes (UCX reads its environment
once), on top of :data:`jaxdsa.kv_transfer.agent.UCX_ENV_DEFAULTS`.

    python -m benchmarks.nixl_read [--sizes-mb 1,8,64] [--repeats 5] [--settings default,tcp,...]

Writes benchmarks/results/nixl_read-<device><suffix>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks import harness

# name -> environment on top of the agent's defaults
SETTINGS = {
    "default": {},
    "tcp": {"UCX_TLS": "tcp"},
    "shm": {"UCX_TLS": "sm,self"},
    "no-cuda": {"UCX_MODULES": "^ib,cuda"},
}
MB = 1 << 20


def _producer(conn, sizes: list[int]) -> None:
    """Registers one buffer per size and sends (metadata, regions); then, per ("fresh", size) request,
    registers a new buffer of that size (dropping the last fresh one) and sends them again, as a
    prefill server offers each request's image today; until "stop"."""
    from jaxdsa.kv_transfer import TransferAgent

    with TransferAgent(f"probe-producer-{os.getpid()}") as agent:
        regions = [agent.register(np.full(n, i + 1, np.uint8)) for i, n in enumerate(sizes)]
        conn.send((agent.metadata(), [r.to_json() for r in regions]))
        fresh = None
        while (message := conn.recv()) != "stop":
            if fresh is not None:
                agent.deregister(fresh)
            fresh = agent.register(np.full(message[1], 7, np.uint8))
            conn.send((agent.metadata(), fresh.to_json()))


def measure(sizes: list[int], repeats: int) -> list[dict]:
    """In this process: one producer child, READs of each size; -> rows (median ms, GB/s)."""
    from jaxdsa.kv_transfer import Region, TransferAgent

    spawn = multiprocessing.get_context("spawn")
    conn, child = spawn.Pipe()
    proc = spawn.Process(target=_producer, args=(child, sizes), daemon=True)
    proc.start()
    rows = []
    try:
        metadata, regions = conn.recv()
        with TransferAgent(f"probe-consumer-{os.getpid()}") as agent:
            peer = agent.connect(metadata)
            for i, (n, remote) in enumerate(zip(sizes, map(Region.from_json, regions))):
                local_buf = np.zeros(n, np.uint8)
                local = agent.register(local_buf)
                times = []
                for _ in range(repeats + 1):  # the first connects the endpoint: not counted
                    start = time.perf_counter()
                    transfer = agent.read(peer, local, remote, b"probe", timeout_s=60)
                    while not transfer.poll():
                        pass
                    times.append(time.perf_counter() - start)
                if not (local_buf == i + 1).all():
                    raise SystemExit(f"nixl_read: a {n}-byte READ brought wrong bytes")
                ms = float(np.median(times[1:])) * 1e3
                row = {"MB": n / MB, "median ms": ms, "GB/s": n / ms / 1e6, "first ms": times[0] * 1e3}
                row["per-request registration ms"] = _fresh_ms(agent, conn, local, n, repeats)
                agent.deregister(local)
                rows.append(row)
    finally:
        conn.send("stop")
        proc.join(30)
    return rows


def _fresh_ms(agent, conn, local, nbytes: int, repeats: int) -> float:
    """Median ms of the servers' per-request path today: the producer registers a new buffer and
    publishes its metadata again, this side loads it (``connect``) and READs (the side channel's time
    left out); the consumer's own buffer stays registered."""
    from jaxdsa.kv_transfer import Region

    times = []
    for _ in range(repeats):
        conn.send(("fresh", nbytes))
        metadata, remote = conn.recv()
        start = time.perf_counter()
        peer = agent.connect(metadata)
        transfer = agent.read(peer, local, Region.from_json(remote), b"probe", timeout_s=60)
        while not transfer.poll():
            pass
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="1,8,64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--suffix", default="")
    p.add_argument("--timeout", type=float, default=60, help="seconds for one setting's processes")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a setting's measuring process prints its rows
    args = p.parse_args(argv)
    sizes = [int(float(s) * MB) for s in args.sizes_mb.split(",")]
    if args.child:
        print(json.dumps(measure(sizes, args.repeats)))
        return 0
    rows = []
    for name in args.settings.split(","):
        env = {**os.environ, **SETTINGS[name]}
        cmd = [sys.executable, "-m", "benchmarks.nixl_read", "--sizes-mb", args.sizes_mb]
        cmd += ["--repeats", str(args.repeats), "--child", name]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rows.append({"setting": name, "error": f"no result in {args.timeout:.0f} s"})
            continue
        if done.returncode:
            rows.append({"setting": name, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        rows += [{"setting": name, **row} for row in json.loads(done.stdout.strip().splitlines()[-1])]
        print(rows[-1], flush=True)
    lines = harness.report_header(
        "NIXL READ between two processes of one host",
        {
            "what": "one producer process registers host buffers and idles; the consumer READs each whole "
            f"buffer {args.repeats} times (median; the first READ, which connects, apart), polling "
            "without pause; per-request registration: the producer registers a new buffer for each "
            "READ and the consumer loads its new metadata first (median ms of load + READ)",
            "settings": "; ".join(f"{k}: {v or 'the agent defaults'}" for k, v in SETTINGS.items()),
        },
    )
    cols = list(dict.fromkeys(k for row in rows for k in row))
    lines += [harness.markdown_table(rows, cols), ""]
    path = harness.write_result("nixl_read", "\n".join(lines), suffix=args.suffix, rows=rows)
    print("\n".join(lines))
    print(f"nixl_read: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
