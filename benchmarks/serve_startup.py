"""How long the README's Quick start server takes to answer ``/health``: cold and warm.

Cold is a first run on a fresh machine: an empty jaxdsa cache directory, so the bundled model is
written and every step shape compiled; warm is the same command again over the cache the cold run
filled. Each start is a fresh ``python -m serve`` process (extra flags after ``--``):

    python -m benchmarks.serve_startup [--runs 1] [-- --max-num-seqs 4]

Writes benchmarks/results/serve_startup-<device>.md and its JSON. The decode issues' newcomer
target: cold <= 45 s and warm <= 10 s on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

from benchmarks import harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_seconds(cache_dir: str, flags: list[str], timeout: float = 900.0) -> float:
    """Seconds from launching the server to its first 200 on /health (the server is stopped after;
    its log goes to a file, which a failure quotes)."""
    port = _free_port()
    env = {**os.environ, "JAXDSA_CACHE_DIR": cache_dir}
    cmd = [sys.executable, "-m", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            harness.wait_health(f"http://127.0.0.1:{port}", server, timeout, poll=0.2)
            return time.perf_counter() - start
        except SystemExit as e:
            log.seek(0)
            raise SystemExit(f"{e}: {log.read()[-2000:]}") from None
        finally:
            server.terminate()
            server.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1, help="cold / warm pairs, each over a fresh cache")
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="jaxdsa-startup-") as cache:
            cold = start_seconds(cache, flags)
            warm = start_seconds(cache, flags)
        rows.append({"run": run + 1, "cold_s": cold, "warm_s": warm})
        print(rows[-1], flush=True)
    lines = harness.report_header(
        "Quick start server: seconds to /health",
        {
            "command": "python -m serve " + " ".join(flags) + " (the bundled model)",
            "machine": f"{os.cpu_count()} CPU cores",
            "cold": "empty JAXDSA_CACHE_DIR: the bundled model written, every step shape compiled",
            "warm": "the same command over the cache the cold start filled",
            "target": "cold <= 45 s, warm <= 10 s (2-core CI machine)",
        },
    )
    lines += [harness.markdown_table(rows, list(rows[0]))]
    path = harness.write_result("serve_startup", "\n".join(lines) + "\n", suffix=args.suffix, rows=rows)
    print("\n".join(lines))
    print(f"serve_startup: wrote {path}")


if __name__ == "__main__":
    main()
