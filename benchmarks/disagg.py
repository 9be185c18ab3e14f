"""Prefill-decode disaggregation on one host's GPUs against one co-located server: how steady running
decode streams stay while long prompts arrive, and what handing each prompt's cache over costs.

The model is :mod:`benchmarks.serve_gpu`'s (a preset's real widths, ``--layers`` deep, random weights
made on the devices). Two layouts over the same ``--gpus`` GPUs, one after the other:

- ``colocated``: one ``python -m serve`` over all of them (``-tp`` = the GPU count);
- ``1p1d``: a prefill server (``kv_producer``) on the first half and a decode server (``kv_consumer``) on
  the second half (``-tp`` = half each, ``CUDA_VISIBLE_DEVICES``), ``python -m serve.router`` in front.
  With ``--gpus 1`` both share the one GPU (``--gpu-memory-utilization`` 0.45 each): the handoff's path
  and costs are the real ones, but the two servers' kernels take turns on the GPU, so the streams' ITL
  is not what separate GPUs give.

The workload, the same for both: ``--streams`` requests of ``--stream-input`` tokens decode (up to
``--stream-output`` tokens each); once all of them stream, ``--long-prompts`` requests of ``--long-len``
tokens arrive ``--long-interval`` seconds apart (``--long-output`` tokens each), and ``--tail`` seconds
after the last of them ends the streams are closed. Reported: the streams'
inter-token latency (ITL) p50 / p99 / max over the gaps that end while long prompts are in flight and
over the others, the long requests' time to first token (TTFT), and in 1P1D the decode server's
transfer counters (bytes, seconds, GB/s, ms per request). Every prompt is random token ids, so no
prefix is shared.

    python -m benchmarks.disagg --preset v4flash --quantization fp8 --layers 24 [--gpus 2] \\
        [--layouts colocated,1p1d] [--suffix -v4flash-24l]

Writes benchmarks/results/disagg-<gpu><suffix>.md and .json (``disagg-partial<suffix>.json`` holds the
rows while the run goes on). Needs NIXL for 1P1D (docs/serving.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.serve_gpu import NAMES, PRESETS, text_config, write_model_dir

try:
    import httpx
except ImportError:  # the serve extra's; only the workload needs it
    httpx = None

LAYOUTS = ("colocated", "1p1d")
SHARED_UTILIZATION = 0.45  # each server's share of the GPU when 1P1D runs on one
# The decode server's transfer counters (jaxdsa/serve/metrics.py), read after the workload.
_RECEIVED = ("received", "received_bytes", "receive_seconds", "failed")


@dataclasses.dataclass
class Timeline:
    """One streamed request: when it was sent, when each token chunk came (perf_counter seconds)."""

    sent: float
    chunks: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


async def stream_request(
    client: Any, url: str, model: str, prompt: list[int], max_tokens: int, line: Timeline | None = None
) -> Timeline:
    """POST one streamed greedy /v1/completions request; the times of its chunks that carry text, in
    ``line`` (a new one by default: a caller that cancels the task keeps what came before)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    line = Timeline(sent=0.0) if line is None else line
    line.sent = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                line.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return line
            async for text in r.aiter_lines():
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                chunk = json.loads(text[6:])
                if "error" in chunk:
                    line.error = str(chunk["error"].get("message"))
                    return line
                if any(c.get("text") for c in chunk.get("choices", [])):
                    line.chunks.append(time.perf_counter())
    except httpx.HTTPError as e:
        line.error = f"{type(e).__name__}: {e}"
    return line


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random regular token ids (the ids above 100 and below the vocab's
    last 100, which hold the special tokens)."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab - 100, size=(n, length)).tolist()


async def workload(url: str, model: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The streams, then the long prompts arriving while they decode; the streams are stopped (their
    requests closed) ``--tail`` seconds after the last long request ends, so they span every arrival
    whatever the decode speed; -> the timelines."""
    streams = random_prompts(args.streams, args.stream_input, vocab, seed=1)
    longs = random_prompts(args.long_prompts, args.long_len, vocab, seed=2)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=256)) as client:
        stream_lines = [Timeline(sent=0.0) for _ in streams]
        running = [
            asyncio.create_task(stream_request(client, url, model, p, args.stream_output, line))
            for p, line in zip(streams, stream_lines)
        ]
        await asyncio.sleep(args.settle)  # every stream past its prefill (checked in the summary)
        arrivals = []
        for p in longs:
            arrivals.append(asyncio.create_task(stream_request(client, url, model, p, args.long_output)))
            await asyncio.sleep(args.long_interval)
        long_lines = await asyncio.gather(*arrivals)
        await asyncio.sleep(args.tail)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return {"streams": stream_lines, "longs": long_lines}


def itl_split(streams: Sequence[Timeline], longs: Sequence[Timeline]) -> tuple[list[float], list[float]]:
    """The streams' gaps between consecutive chunks (ms), split by whether a gap ends while a long
    request is in flight (from its sending to its last chunk): (during, outside)."""
    windows = [(line.sent, line.chunks[-1]) for line in longs if line.chunks]
    during, outside = [], []
    for line in streams:
        for a, b in zip(line.chunks, line.chunks[1:]):
            gap = (b - a) * 1e3
            (during if any(lo <= b <= hi for lo, hi in windows) else outside).append(gap)
    return during, outside


def summarize(timelines: dict[str, list[Timeline]], settle_s: float) -> dict[str, Any]:
    """The layout's row: ITL p50 / p99 / max during and outside the long prompts, the long requests'
    TTFT, failures."""
    streams, longs = timelines["streams"], timelines["longs"]
    late = [line for line in streams if line.chunks and line.chunks[0] - line.sent > settle_s]
    during, outside = itl_split(streams, longs)
    ttft = [(line.chunks[0] - line.sent) * 1e3 for line in longs if line.chunks]

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    return {
        "ITL p50 ms (long prompts in flight)": pct(during, 50),
        "ITL p99 ms (long prompts in flight)": pct(during, 99),
        "ITL max ms (long prompts in flight)": max(during, default=float("nan")),
        "ITL p50 ms (otherwise)": pct(outside, 50),
        "ITL p99 ms (otherwise)": pct(outside, 99),
        "gaps (in flight / otherwise)": f"{len(during)} / {len(outside)}",
        "long TTFT mean ms": float(np.mean(ttft)) if ttft else float("nan"),
        "long TTFT max ms": max(ttft, default=float("nan")),
        "failed": sum(bool(line.error) for line in (*streams, *longs)),
        "streams not decoding when the first long prompt came": len(late),
    }


def metric_values(text: str, prefix: str) -> dict[str, float]:
    """Prometheus text exposition -> {name without ``prefix``: value} for the samples named
    ``prefix``*, labels ignored (summed)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            key = name.split("{")[0][len(prefix) :]
            values[key] = values.get(key, 0.0) + float(value)
    return values


def transfer_row(metrics: dict[str, float]) -> dict[str, Any]:
    """The decode server's ``jaxdsa:kv_transfer_*`` counters -> requests, MB, GB/s, ms per request."""
    n = metrics.get("received_total", 0.0)
    nbytes, seconds = metrics.get("received_bytes_total", 0.0), metrics.get("receive_seconds_total", 0.0)
    return {
        "transfers": int(n),
        "transfer MB per request": nbytes / n / 1e6 if n else float("nan"),
        "transfer ms per request": seconds / n * 1e3 if n else float("nan"),
        "transfer GB/s": nbytes / seconds / 1e9 if seconds else float("nan"),
        "transfers failed": int(metrics.get("failed_total", 0.0)),
    }


@contextlib.contextmanager
def process(cmd: list[str], log_path: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A server process with its output in ``log_path``; stopped (and its log's tail printed) on exit."""
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            with open(log_path, encoding="utf-8") as fh:
                print(f"--- {os.path.basename(log_path)} (tail)\n{fh.read()[-3000:]}", flush=True)


def server_command(
    args: argparse.Namespace, work: str, port: int, tp: int, extra: Sequence[str]
) -> list[str]:
    """``python -m serve`` over the model directory with the benchmark's flags."""
    return [
        sys.executable,
        "-m",
        "serve",
        work,
        "--load-format",
        "dummy",
        "--quantization",
        args.quantization,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "model",
        "--max-model-len",
        str(max(args.long_len + args.long_output, args.stream_input + args.stream_output) + 64),
        "--max-num-seqs",
        str(args.streams + args.long_prompts),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--tensor-parallel-size",
        str(tp),
        *extra,
        *shlex.split(args.server_args),
    ]


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def run_layout(layout: str, args: argparse.Namespace, work: str, vocab: int) -> dict[str, Any]:
    """Start the layout's servers, run the workload, stop them; -> its row."""
    gpus = list(range(args.gpus))
    half = max(1, len(gpus) // 2)
    shared = ["--gpu-memory-utilization", str(SHARED_UTILIZATION)] if len(gpus) == 1 else []

    def visible(devices: list[int]) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}

    started = time.time()
    with contextlib.ExitStack() as stack:
        if layout == "colocated":
            url = f"http://127.0.0.1:{args.port}"
            cmd = server_command(args, work, args.port, len(gpus), [])
            proc = stack.enter_context(process(cmd, os.path.join(work, "colocated.log")))
            harness.wait_health(url, proc, args.start_timeout)
            decode_url = None
        else:
            prefill_url, decode_url = f"http://127.0.0.1:{args.port + 1}", f"http://127.0.0.1:{args.port + 2}"
            servers = []
            for role, port, devices in (
                ("kv_producer", args.port + 1, gpus[:half]),
                ("kv_consumer", args.port + 2, gpus[-half:]),
            ):
                config = json.dumps({"kv_connector": "NixlConnector", "kv_role": role})
                cmd = server_command(args, work, port, half, ["--kv-transfer-config", config, *shared])
                log = os.path.join(work, f"{role}.log")
                servers.append(stack.enter_context(process(cmd, log, visible(devices))))
            for server_url, proc in zip((prefill_url, decode_url), servers):
                harness.wait_health(server_url, proc, args.start_timeout)
            url = f"http://127.0.0.1:{args.port}"
            router = [
                sys.executable, "-m", "serve.router", "--port", str(args.port),
                "--prefill", prefill_url, "--decode", decode_url,
            ]  # fmt: skip
            proc = stack.enter_context(process(router, os.path.join(work, "router.log")))
            harness.wait_health(url, proc, 60)
        startup = time.time() - started
        timelines = asyncio.run(workload(url, "model", args, vocab))
        row = {"layout": layout, **summarize(timelines, args.settle)}
        if decode_url:
            row |= transfer_row(metric_values(_metrics(decode_url), "jaxdsa:kv_transfer_"))
    row["servers up s"] = startup
    errors = sorted({line.error for lines in timelines.values() for line in lines if line.error})
    if errors:
        print(f"disagg: {layout}: {len(errors)} distinct errors, e.g. {errors[:3]}", flush=True)
    return row


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    half = args.gpus // 2
    split = (
        f"prefill server -tp {half} on GPUs 0-{half - 1} (kv_producer), decode server -tp {half} on GPUs "
        f"{half}-{args.gpus - 1} (kv_consumer)"
        if half
        else f"prefill (kv_producer) and decode (kv_consumer) servers both on GPU 0, "
        f"--gpu-memory-utilization {SHARED_UTILIZATION} each (their kernels take turns)"
    )
    lines = harness.report_header(
        f"Prefill-decode disaggregation: {NAMES[args.preset]} widths, {args.layers} layers",
        {
            "model": f"{NAMES[args.preset]} widths, {args.layers} layers, random weights "
            f"(--load-format dummy --quantization {args.quantization})",
            "colocated": f"one server, -tp {args.gpus} over GPUs 0-{args.gpus - 1}",
            "1p1d": f"{split}, NixlConnector, serve.router in front",
            "server flags": f"--max-num-batched-tokens {args.max_num_batched_tokens} "
            f"--max-num-seqs {args.streams + args.long_prompts} {args.server_args}".strip(),
            "workload": f"{args.streams} streams of {args.stream_input} tokens in; after "
            f"{args.settle:.0f} s, {args.long_prompts} prompts of {args.long_len} tokens "
            f"({args.long_output} out) {args.long_interval:.1f} s apart; the streams closed "
            f"{args.tail:.0f} s after the last ends; greedy, ignore_eos, streamed",
        },
    )
    cols = list(dict.fromkeys(k for row in rows for k in row))
    lines += [
        "ITL: gaps between a stream's consecutive tokens, split by whether the gap ended while a long",
        "prompt was in flight (sent, not yet finished). Transfers: the decode server's",
        "jaxdsa:kv_transfer_* counters (the NIXL READ of each prompt's cache image, host memory on both",
        "sides).",
        "",
        harness.markdown_table(rows, cols),
        "",
    ]
    path = harness.write_result("disagg", "\n".join(lines), suffix=args.suffix, rows=rows)
    print("\n".join(lines), flush=True)
    print(f"disagg: wrote {path}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="v4flash")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--quantization", default="fp8")
    p.add_argument(
        "--overrides", default="{}", help="JSON config overrides (CPU smoke runs use small widths)"
    )
    p.add_argument("--gpus", type=int, default=2, help="1, or even: 1P1D splits them in halves")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-input", type=int, default=256)
    p.add_argument(
        "--stream-output", type=int, default=4096, help="at most (the streams stop after the longs)"
    )
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--long-interval", type=float, default=2.0)
    p.add_argument("--settle", type=float, default=5.0, help="seconds between the streams and the first long")
    p.add_argument("--tail", type=float, default=2.0, help="seconds the streams go on after the last long")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--server-args", default="", help="more flags for every server, as one word")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        p.error(f"--layouts: unknown {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    if args.gpus > 1 and args.gpus % 2:
        p.error("--gpus must be 1 or even (1P1D gives each server half)")
    work = tempfile.mkdtemp(prefix="disagg-")
    raw = write_model_dir(work, args.layers, json.loads(args.overrides), args.preset)
    vocab = text_config(raw)["vocab_size"]
    # The results file names the GPU, which needs JAX on it in this process: written once no server
    # runs. Until then each layout's row goes to a plain JSON file, so a run cut short keeps them.
    partial = harness.results_dir() / f"disagg-partial{args.suffix}.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for layout in layouts:
        rows.append(run_layout(layout, args, work, vocab))
        harness.dump_json(str(partial), rows)
    report(rows, args)
    partial.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
