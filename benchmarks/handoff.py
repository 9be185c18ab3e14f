"""Prefill-decode handoff at real widths on one GPU: what moving a prompt's cache between servers costs.

Builds a model of a preset's widths with random weights on the device (as
:mod:`benchmarks.serve_gpu`) and, in one process, three engines over it: one serving alone (the
co-located reference), a prefill engine and a decode engine, the last two each with a NIXL
connector (:mod:`jaxdsa.kv_transfer`) as their servers would have. For each prompt length, after a
warm-up round at that length:

- co-located: time to the first token, then the greedy tokens and time per token of the decode;
- handed over: the prefill engine's time to its first token with the cache image exported (the
  gather from the device cache and the copy to host memory), the offer (NIXL registration), then
  the decode engine's time from the request to its first token (NIXL READ into a registered host
  buffer, the copy to the device and the scatter into its pages), the READ alone (its GB/s), and
  the same decode's time per token; the tokens must equal the co-located ones.

The image lives in host memory on both sides (``docs/serving.md``): this measures that path, whose
device-host copies a VRAM registration would remove.

    python -m benchmarks.handoff --preset v4flash --quantization fp8 --layers 8 [--lengths 1024,4096,8192]

Writes benchmarks/results/handoff-<gpu><suffix>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

from benchmarks import harness
from benchmarks.serve_gpu import PRESETS, add_parallel_arguments, dummy_llm, write_model_dir
from jaxdsa.engine import Engine, SamplingParams
from jaxdsa.kv_transfer.config import KVTransferConfig
from jaxdsa.kv_transfer.connector import KVConnector

DECODE_TOKENS = 16


def until_done(engine: Engine, rid: str, start: float) -> tuple[list[int], float, float]:
    """Step ``engine`` until request ``rid`` ends: (its tokens, seconds from ``start`` to its first
    output, seconds from its first output to its last)."""
    first, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            if first is None:
                first = time.perf_counter()
            tokens += out.new_token_ids
            if out.error:
                raise SystemExit(f"{rid}: {out.error}")
    return tokens, first - start, time.perf_counter() - first


def one_length(engines: dict, connectors: dict, prompt: list[int], tag: str) -> dict:
    n = len(prompt)
    greedy = SamplingParams(max_tokens=1 + DECODE_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    engines["alone"].add_request(f"alone-{tag}", prompt, greedy)
    expected, ttft, alone_tail = until_done(engines["alone"], f"alone-{tag}", start)

    start = time.perf_counter()
    engines["prefill"].add_request(f"prefill-{tag}", prompt, SamplingParams(max_tokens=1), export=True)
    image = None
    while engines["prefill"].has_unfinished():
        for out in engines["prefill"].step():
            image = out.cache_image or image
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    params = connectors["prefill"].offer(image)
    offer_s = time.perf_counter() - start

    received = connectors["decode"].stats.receive_seconds
    start = time.perf_counter()
    source = connectors["decode"].source(params)
    engines["decode"].add_request(f"decode-{tag}", prompt, greedy, source=source)
    got, first_s, tail = until_done(engines["decode"], f"decode-{tag}", start)
    read_s = connectors["decode"].stats.receive_seconds - received
    mb = image.data.nbytes / 1e6
    return {
        "input_len": n,
        "image_mb": round(mb, 1),
        "alone_ttft_ms": round(ttft * 1e3, 1),
        "prefill_and_export_ms": round(prefill_s * 1e3, 1),
        "offer_ms": round(offer_s * 1e3, 2),
        "decode_first_token_ms": round(first_s * 1e3, 1),
        "nixl_read_ms": round(read_s * 1e3, 1),
        "nixl_read_gbs": round(mb / 1e3 / read_s, 2) if read_s else None,
        "alone_ms_per_token": round(alone_tail / DECODE_TOKENS * 1e3, 2),
        "handed_ms_per_token": round(tail / DECODE_TOKENS * 1e3, 2),
        "tokens_equal": got == expected,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="v4flash")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--suffix", default="")
    p.add_argument("--overrides", default="{}", help="JSON config overrides (CPU runs use small widths)")
    add_parallel_arguments(p)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + DECODE_TOKENS + 8
    work = tempfile.mkdtemp(prefix="handoff-")
    raw = write_model_dir(work, args.layers, json.loads(args.overrides), preset=args.preset)
    llm = dummy_llm(work, args, max_model_len=max_len, page_size=args.page_size, max_num_seqs=2)
    pages = 2 * (-(-max_len // llm.page_size)) + 4
    config = dict(num_pages=pages, max_num_batched_tokens=2048)
    engines = {role: llm.new_engine(**config) for role in ("alone", "prefill", "decode")}
    connectors = {
        "prefill": KVConnector(
            KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}')
        ),
        "decode": KVConnector(
            KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}')
        ),
    }
    rng = np.random.default_rng(0)
    rows = []
    try:
        for n in lengths:
            # the warm-up compiles this length's shapes; its prompt is another, so that no prefix
            # cache hit shortens the measured prefill
            one_length(engines, connectors, rng.integers(2, raw["vocab_size"], n).tolist(), f"warm{n}")
            prompt = rng.integers(2, raw["vocab_size"], n).tolist()
            rows.append(one_length(engines, connectors, prompt, str(n)))
            print(rows[-1], flush=True)
    finally:
        for c in connectors.values():
            c.close()
    columns = list(rows[0])
    title = f"Prefill-decode handoff, {args.preset} widths, {args.layers} layers, {args.quantization}"
    text = harness.report_header(title, {"page size": llm.page_size, "decode tokens": DECODE_TOKENS})
    text += [harness.markdown_table(rows, columns), ""]
    path = harness.write_result("handoff", "\n".join(text), args.suffix, rows)
    print(path)
    return path


if __name__ == "__main__":
    main()
