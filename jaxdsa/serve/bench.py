"""Serving benchmark against any OpenAI-compatible server (jaxdsa or vLLM), like vLLM's bench serve.

    python -m jaxdsa.serve.bench --url http://127.0.0.1:8000 --concurrency 1,4,8,16,32 \\
        --input-len 128 --output-len 128 --num-prompts 64 [--model NAME] [--plot out.png] [--json out.json]

Prompts are random words cut to exactly ``--input-len`` tokens with the server's ``/tokenize``
(vLLM and jaxdsa both have it) and sent as token ids to ``/v1/completions`` with ``ignore_eos``,
so every request reads and writes exactly the asked lengths. Responses are streamed to time the
first token (TTFT) and the gaps between later chunks (ITL). For each concurrency level,
``--num-prompts`` requests run with at most that many in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    import httpx
except ImportError:  # httpx comes with the openai client; the server itself does not need it
    httpx = None

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact model token cache page expert router attention sparse "
    "the of and to in is was for on are with as at be this have from or one had by word but not what all "
    "were when we there can an your which their said if do will each about how up out them then she many"
).split()


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _model_info(client: httpx.AsyncClient, url: str, model: str | None) -> tuple[str, int | None]:
    r = await client.get(f"{url}/v1/models")
    r.raise_for_status()
    cards = r.json()["data"]
    card = next((c for c in cards if c["id"] == model), None) if model else cards[0]
    if card is None:
        raise SystemExit(
            f"bench: model {model!r} is not served at {url} (it serves {[c['id'] for c in cards]})"
        )
    return card["id"], card.get("max_model_len")


async def _prompts(
    client: httpx.AsyncClient, url: str, model: str, n: int, input_len: int, seed: int
) -> list[list[int]]:
    """n random-word prompts of exactly input_len tokens each."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < input_len:
            text = " ".join(rng.choice(_WORDS) for _ in range(2 * input_len))
            r = await client.post(
                f"{url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False}
            )
            if r.status_code == 404:
                raise SystemExit(
                    f"bench: {url} has no /tokenize endpoint, which the benchmark needs to build "
                    "exact-length prompts"
                )
            r.raise_for_status()
            ids = r.json()["tokens"]
        prompts.append(ids[:input_len])
    return prompts


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result, last = RequestResult(ok=False), None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(
                    ok=False, error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                )
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(ok=False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    result.ok = last is not None
    return result


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


async def _level(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)

    async def run(prompt: list[int]) -> RequestResult:
        async with gate:
            return await _one(client, url, model, prompt, output_len)

    start = time.perf_counter()
    results = await asyncio.gather(*(run(p) for p in prompts))
    duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "failed": len(prompts) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = [
        "conc",
        "reqs",
        "fail",
        "out tok/s",
        "total tok/s",
        "TTFT mean",
        "TTFT med",
        "TTFT p99",
        "ITL mean",
        "ITL med",
        "ITL p99",
    ]
    lines = ["  ".join(f"{c:>11}" for c in cols) + "   (latencies in ms)"]
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        values = [
            r["concurrency"],
            r["requests"],
            r["failed"],
            r["output_throughput"],
            r["total_throughput"],
            t["mean"],
            t["median"],
            t["p99"],
            i["mean"],
            i["median"],
            i["p99"],
        ]
        lines.append("  ".join(f"{v:>11}" if isinstance(v, int) else f"{v:>11.1f}" for v in values))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> bool:
    """tok/s against concurrency; False (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: --plot needs matplotlib (pip install matplotlib); skipped the plot", file=sys.stderr)
        return False
    levels = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, [r["output_throughput"] for r in rows], marker="o", label="output tok/s")
    ax.plot(levels, [r["total_throughput"] for r in rows], marker="s", label="total tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


MIN_REQUESTS = 3  # a level never measures fewer requests than this


def _level_requests(args: argparse.Namespace, concurrency: int) -> int:
    """Requests a level sends: ``--requests-per-stream`` times its concurrency (at least
    MIN_REQUESTS), else ``--num-prompts`` (default 4 x the largest concurrency) at every level."""
    if args.requests_per_stream:
        return max(MIN_REQUESTS, args.requests_per_stream * concurrency)
    return args.num_prompts or 4 * max(int(c) for c in args.concurrency.split(","))


async def run_benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    url = args.url.rstrip("/")
    levels = [int(c) for c in args.concurrency.split(",")]
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=30.0), headers=_headers(args.api_key)
    ) as client:
        model, max_model_len = await _model_info(client, url, args.model)
        if max_model_len and args.input_len + args.output_len > max_model_len:
            raise SystemExit(
                f"bench: --input-len + --output-len = {args.input_len + args.output_len} exceeds the "
                f"server's max_model_len {max_model_len}"
            )
        per_level = {c: _level_requests(args, c) for c in levels}
        num = max(per_level.values())
        prompts = await _prompts(client, url, model, num, args.input_len, args.seed)
        counts = "/".join(str(per_level[c]) for c in levels)
        print(
            f"bench: {model} at {url}: {counts} prompts x {args.input_len} in / {args.output_len} out "
            f"at concurrency {args.concurrency}",
            file=sys.stderr,
        )
        warm = await _one(client, url, model, prompts[0], min(args.output_len, 4))
        if not warm.ok:
            raise SystemExit(f"bench: warm-up request failed: {warm.error}")
        rows = []
        for c in levels:
            rows.append(await _level(client, url, model, prompts[: per_level[c]], args.output_len, c))
            print(
                f"bench: concurrency {c}: {rows[-1]['output_throughput']:.1f} output tok/s", file=sys.stderr
            )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m jaxdsa.serve.bench",
        description="Throughput and latency of an OpenAI-compatible server.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated concurrency levels")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--num-prompts", type=int, help="requests per level (default: 4 x the largest concurrency)"
    )
    p.add_argument(
        "--requests-per-stream",
        type=int,
        help=f"instead: each level sends this many requests per concurrent stream (at least {MIN_REQUESTS})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a tok/s-vs-concurrency PNG here (needs matplotlib)")
    args = p.parse_args(argv)
    if httpx is None:
        raise SystemExit("bench: needs httpx (pip install httpx)")
    if args.input_len < 1 or args.output_len < 1:
        raise SystemExit("bench: --input-len and --output-len must be >= 1")
    try:
        rows = asyncio.run(run_benchmark(args))
    except httpx.HTTPError as e:
        raise SystemExit(f"bench: cannot reach {args.url}: {e}") from e
    print(format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "url": args.url,
                    "input_len": args.input_len,
                    "output_len": args.output_len,
                    "results": rows,
                },
                fh,
                indent=2,
            )
    if args.plot:
        plot(rows, args.plot, f"{args.input_len} in / {args.output_len} out")


if __name__ == "__main__":
    main()
