"""Serving benchmark of a model of real widths on one GPU: `python -m serve` + `jaxdsa.serve.bench`.

The model has GLM-5's real layer widths (hidden 6144, 64 heads, MLA 2048/512/192+64/256,
indexer 32 x 128, top-2048, 256 experts top-8 x 2048, vocab 154880), GLM-5.2's (``--preset
glm52``: the same widths, shared indexer layers, longer RoPE), DeepSeek-V4-Flash's (``--preset
v4flash``: the first layers of its schedule, no MTP block) or GLM-5.3-Flash's (``--preset glm53flash``:
KDA and NoPE DSA layers in the release's schedule), and as many layers as the GPUs hold
next to a useful cache, with random weights made on the device (``--load-format dummy``) in bf16
or kept quantized (``--quantization int4|fp8``). The memory roofline is the planner's
(:func:`jaxdsa.plan.decode_step`): every weight one decode step of ``batch`` sequences touches, at
its stored width (routed experts at their expected number under uniform routing), plus the cache
rows of every sequence's context, divided by the memory ceiling measured in the same run (the
fastest of JAX's and torch's copy and read-only streams). The weights the server reports per
device are set against the planner's prediction.

    python -m benchmarks.serve_gpu [--preset glm5|glm52] [--layers 5] [--quantization int4] \
        [--input-len 512] [--output-len 64]

Writes benchmarks/results/serve-<gpu>[<suffix>].md (and the raw bench JSON beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks import anatomy, harness
from jaxdsa import LLM, plan
from jaxdsa.cache import KV_CACHE_DTYPES, kv_cache_format
from jaxdsa.checkpoints.tokenizer_assets import write_tokenizer
from jaxdsa.models.deepseek_v4.presets import RELEASED
from jaxdsa.models.dsa.presets import RELEASED as DSA_RELEASED
from jaxdsa.models.glm5_next.presets import GLM53_FLASH
from jaxdsa.models.registry import config_from_dict, family_for
from jaxdsa.sharding import Parallelism

# The released configs (jaxdsa.models.dsa.presets) without their MTP block.
GLM5 = {**DSA_RELEASED["glm5"], "num_nextn_predict_layers": 0}
GLM52 = {**DSA_RELEASED["glm52"], "num_nextn_predict_layers": 0}
# DeepSeek-V4-Flash's widths; the first layers of its schedule (two sliding-window layers, then CSA
# and HCA alternating) and no MTP block.
V4FLASH = {**RELEASED["v4-flash"], "num_nextn_predict_layers": 0}
PRESETS = {"glm5": GLM5, "glm52": GLM52, "v4flash": V4FLASH, "glm53flash": GLM53_FLASH}
NAMES = {"glm5": "GLM-5", "glm52": "GLM-5.2", "v4flash": "DeepSeek-V4-Flash", "glm53flash": "GLM-5.3-Flash"}
# Per-layer lists cut to the first ``layers`` entries when a preset is shortened.
_LAYER_LISTS = ("layer_types", "indexer_types", "mlp_layer_types")


def text_config(raw: dict) -> dict:
    """The language model's fields: ``text_config`` for the multimodal layouts (GLM-5.3-Flash), else
    the file's top level."""
    return raw.get("text_config", raw)


WEIGHTS = {"dequantize": "bf16", "int4": "int4", "fp8": "fp8"}  # --quantization -> the planner's --weights


def write_model_dir(directory: str, layers: int, overrides: dict | None = None, preset: str = "glm5") -> dict:
    """config.json (``preset``'s widths, ``layers`` layers) + the GLM tokenizer files; no weights.

    The bundled tokenizer has 512 tokens; a random model samples from the whole vocabulary, so the
    BPE vocab is padded with filler tokens up to vocab_size (they decode to text but tokenization
    never produces them) and every streamed token carries text, as with a real tokenizer.
    """
    base = PRESETS[preset]
    text = text_config(base)
    shape: dict = {"num_hidden_layers": layers}
    shape |= {key: text[key][:layers] for key in _LAYER_LISTS if key in text}
    if preset == "glm5":
        shape["indexer_types"] = ["full"] * layers
    if preset == "v4flash":
        shape |= {"compress_ratios": base["compress_ratios"][:layers], "num_hash_layers": min(3, layers)}
    if "text_config" in base:
        raw = {**base, "text_config": {**text, **shape, **(overrides or {})}}
    else:
        raw = {**base, **shape, **(overrides or {})}
    text = text_config(raw)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(raw, fh, indent=1)
    write_tokenizer(raw["model_type"], directory, model_max_length=text["max_position_embeddings"])
    path = os.path.join(directory, "tokenizer.json")
    with open(path, encoding="utf-8") as fh:
        tok = json.load(fh)
    vocab = tok["model"]["vocab"]
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})  # keeps their ids once the vocab grows
    vocab.update({f"<filler{i}>": i for i in range(max(vocab.values()) + 1, text["vocab_size"])})
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(tok, fh)
    return raw


def step_bytes(
    raw: dict,
    weights: str,
    context: int,
    batch: int,
    par: Parallelism | None = None,
    kv_format: str = "model",
) -> float:
    """Bytes one decode step of ``batch`` sequences (per dp group) at ``context`` tokens reads on one
    GPU (the planner's), with the model split as ``par`` says (default: one GPU) and the cache rows
    in ``kv_format`` (``'model'``: bf16, or ``'fp8'``)."""
    cfg = config_from_dict(raw)
    family = family_for(cfg.model_type)
    step = plan.decode_step(family, cfg, par or Parallelism(), weights, batch, context, kv_format=kv_format)
    return step["bytes_read"]


def planned_weight_bytes(raw: dict, weights: str, par: Parallelism | None = None) -> float:
    """Weight bytes on one GPU, as the planner counts them."""
    cfg = config_from_dict(raw)
    return plan.device_weight_bytes(family_for(cfg.model_type), cfg, par or Parallelism(), weights)


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's (vLLM's) parallelism flags, for the benchmarks that build a mesh."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--expert-parallel-size", "-ep", type=int, default=1)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    parser.add_argument("--enable-dp-attention", action="store_true")


def describe(par: Parallelism, unit: str = "device(s)") -> str:
    """``-tp 4 -ep 1 -dp 1 (4 device(s))``, as a results header states a mesh."""
    return (
        f"-tp {par.tp} -ep {par.ep} -dp {par.dp}"
        + " --enable-dp-attention" * par.dp_attention
        + f" ({par.num_devices} {unit})"
    )


def dummy_llm(directory: str, args: argparse.Namespace, **options) -> LLM:
    """``jaxdsa.LLM`` over :func:`write_model_dir`'s config with random weights made on the devices,
    kept in ``args.quantization``'s format, split as :func:`add_parallel_arguments`' flags say;
    ``options``: the other ``LLM`` arguments."""
    par = parallelism(args)
    return LLM(
        directory,
        load_format="dummy",
        quantization=args.quantization,
        progress=False,
        tp=par.tp,
        ep=par.ep,
        dp=par.dp,
        dp_attention=par.dp_attention,
        **options,
    )


def parallelism(args: argparse.Namespace) -> Parallelism:
    """The mesh of :func:`add_parallel_arguments`' flags."""
    return Parallelism(
        tp=args.tensor_parallel_size,
        ep=args.expert_parallel_size,
        dp=args.data_parallel_size,
        dp_attention=args.enable_dp_attention,
    )


def _post(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(
        f"{url}{path}", data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.load(r)


def profile_decode(url: str, model: str, directory: str, prompt: list[int], steps: int) -> dict:
    """One request of ``steps`` tokens traced through the server's /start_profile and /stop_profile,
    reduced by :mod:`benchmarks.anatomy` (the prefill and the first decode step left out)."""
    _post(url, "/start_profile")
    try:
        _post(
            url,
            "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": steps, "ignore_eos": True},
        )
    finally:
        _post(url, "/stop_profile")
    traces = sorted(pathlib.Path(directory).rglob("perfetto_trace.json.gz"))
    try:
        return anatomy.anatomy(anatomy.load(str(traces[-1])), skip=2)
    except (ValueError, IndexError) as e:  # no trace written, or no GPU kernels in it (a CPU run)
        return {"error": f"no anatomy: {e or 'no trace written'}"}


def serve_and_bench(args, raw: dict, work: str, par: Parallelism, levels: list[int], scheduling: str) -> dict:
    """Start the server (``scheduling``: async or sync), run jaxdsa.serve.bench over ``levels`` and, with
    ``--profile-steps``, trace one stream's decode; -> rows, start-up seconds, weights per GPU,
    anatomy."""
    url = f"http://127.0.0.1:{args.port}"
    profile_dir = os.path.join(work, f"profile-{scheduling}")
    cmd = [
        sys.executable,
        "-m",
        "serve",
        work,
        "--load-format",
        "dummy",
        "--quantization",
        args.quantization,
        "--port",
        str(args.port),
        "--host",
        "127.0.0.1",
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(max(levels)),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--served-model-name",
        f"{args.preset}-shaped",
        "--tensor-parallel-size",
        str(par.tp),
        "--expert-parallel-size",
        str(par.ep),
        "--data-parallel-size",
        str(par.dp),
        "--profile-dir",
        profile_dir,
        "--async-scheduling" if scheduling == "async" else "--no-async-scheduling",
        *["--enable-dp-attention"] * par.dp_attention,
        "--kv-cache-dtype",
        args.kv_cache_dtype,
        *shlex.split(args.server_args),
    ]
    start = time.time()
    log_path = os.path.join(work, f"serve-{scheduling}.log")
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed after the server ends)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    profile = None
    try:
        harness.wait_health(url, server, timeout=900)
        startup = time.time() - start
        out_json = os.path.join(work, f"bench-{scheduling}.json")
        bench = [
            sys.executable,
            "-m",
            "jaxdsa.serve.bench",
            "--url",
            url,
            "--concurrency",
            args.concurrency,
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            *(["--requests-per-stream", str(args.requests_per_stream)] if args.requests_per_stream else []),
            "--num-prompts",
            str(args.num_prompts),
            "--json",
            out_json,
        ]
        subprocess.run(bench, check=True)
        if args.profile_steps:
            vocab = text_config(raw)["vocab_size"]
            prompt = [(97 * i + 13) % (vocab - 100) + 100 for i in range(args.input_len)]
            profile = profile_decode(url, f"{args.preset}-shaped", profile_dir, prompt, args.profile_steps)
            if args.keep_trace:  # beside the results, for reading the host threads too
                harness.results_dir().mkdir(parents=True, exist_ok=True)
                for trace in pathlib.Path(profile_dir).rglob("perfetto_trace.json.gz"):
                    shutil.copy(
                        trace,
                        harness.results_dir() / f"trace-{args.preset}{args.suffix}-{scheduling}.json.gz",
                    )
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
        with open(log_path, encoding="utf-8") as fh:
            server_log = fh.read()
        print(server_log[-4000:])
    rows = json.load(open(out_json))["results"]
    for row in rows:
        row["scheduling"] = scheduling
    loaded = re.search(r"weights ([0-9.]+) GiB per device", server_log)
    weights_gib = float(loaded.group(1)) if loaded else float("nan")
    return {
        "scheduling": scheduling,
        "rows": rows,
        "startup": startup,
        "weights_gib": weights_gib,
        "anatomy": profile,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", choices=sorted(PRESETS), default="glm5")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--quantization", choices=sorted(WEIGHTS), default="dequantize")
    p.add_argument("--suffix", default="", help="results file name suffix, e.g. -glm52-int4")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument(
        "--requests-per-stream",
        type=int,
        help="jaxdsa.serve.bench's: requests per level = this x concurrency",
    )
    p.add_argument("--concurrency", default="1,4,8,16,32")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument(
        "--overrides", default="{}", help="JSON config overrides (CPU smoke tests use small widths)"
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--torch-ceilings", action="store_true", help="measure torch's streams too")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the server's; the roofline counts it",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after the levels, trace one stream decoding this many tokens (benchmarks.anatomy)",
    )
    p.add_argument("--keep-trace", action="store_true", help="copy the profiled traces beside the results")
    p.add_argument(
        "--compare-sync",
        action="store_true",
        help="serve a second time with --no-async-scheduling (the engine loop before async scheduling)",
    )
    # the server's (and vLLM's) parallelism flags, passed on; the planner splits the model the same way
    add_parallel_arguments(p)
    p.add_argument(
        "--server-args",
        default="",
        help="more flags for the server, as one word: --server-args='--disable-shared-experts-fusion ...' "
        "(named in the results header)",
    )
    args = p.parse_args(argv)
    par = parallelism(args)  # checked before anything starts

    levels = [int(c) for c in args.concurrency.split(",")]
    if not args.requests_per_stream and args.num_prompts < max(levels):  # too few to reach the level
        p.error(f"--num-prompts {args.num_prompts} is below the highest --concurrency ({max(levels)})")
    work = tempfile.mkdtemp(prefix=f"{args.preset}-shaped-")
    raw = write_model_dir(work, args.layers, json.loads(args.overrides), args.preset)
    runs = [serve_and_bench(args, raw, work, par, levels, "async")]
    if args.compare_sync:
        runs.append(serve_and_bench(args, raw, work, par, levels, "sync"))
    # Only now touch the GPU from this process (the servers are gone): the ceilings, torch's too.
    _report(runs, raw, args, harness.measure_ceilings(torch_peers=args.torch_ceilings))
    return 0


def moe_tokens(concurrency: int, par: Parallelism) -> int:
    """Decode tokens that meet at one MoE layer's experts: a dp group's sequences, times the groups
    whose tokens share the experts (dp attention); plain dp replicas route their own. The count
    :func:`jaxdsa.plan.decode_step` takes the expected experts of."""
    return -(-concurrency // par.dp) * par.axis_sizes["edp"]


def _parallel_flags(par: Parallelism) -> str:
    """The server's parallelism flags as the report names them ('' on one GPU)."""
    return "" if (par.tp, par.ep, par.dp) == (1, 1, 1) else f" {describe(par, 'GPUs')}"


def _report(runs: list[dict], raw, args, ceilings: harness.Ceilings) -> None:
    context = args.input_len + args.output_len / 2
    header = harness.device_header()
    par = parallelism(args)
    kv_format = kv_cache_format(args.kv_cache_dtype, "bfloat16")  # the roofline's cache rows
    table = []
    for r in (row for run in runs for row in run["rows"]):
        itl = r["itl_ms"]["mean"]
        per_stream = 1000.0 / itl if itl == itl and itl > 0 else float("nan")
        row = {
            "scheduling": r["scheduling"],
            "concurrency": r["concurrency"],
            "per-stream decode tok/s": per_stream,
            "aggregate decode tok/s": per_stream * r["concurrency"],
            "output tok/s (incl. prefill)": r["output_throughput"],
            "total tok/s": r["total_throughput"],
            "TTFT mean ms": r["ttft_ms"]["mean"],
            "ITL mean ms": itl,
            "ITL p99 ms": r["itl_ms"]["p99"],
            "failed": r["failed"],
        }
        batch = -(-r["concurrency"] // par.dp)  # sequences per dp group
        nbytes = step_bytes(raw, WEIGHTS[args.quantization], int(context), batch, par, kv_format)
        text = text_config(raw)
        row["routed experts/layer"] = plan.expected_experts(
            text["n_routed_experts"], text["num_experts_per_tok"], moe_tokens(r["concurrency"], par)
        )
        row["bytes/step GB"] = nbytes / 1e9
        row["roofline ms"] = nbytes / (ceilings.stream_gbs * 1e9) * 1e3
        row["% of roofline"] = 100 * row["roofline ms"] / itl if itl == itl else float("nan")
        table.append(row)
    cols = list(table[0])
    name = NAMES[args.preset]
    planned = planned_weight_bytes(raw, WEIGHTS[args.quantization], par)
    cfg = config_from_dict(raw)
    if cfg.model_type == "deepseek_v4":
        layers = ", ".join(cfg.layer_types)
    elif cfg.model_type == "glm5_next":
        kinds = [*cfg.layer_types, *cfg.mlp_layer_types]
        layers = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
    else:
        dense = cfg.first_k_dense_replace
        layers = f"{dense} dense + {cfg.num_hidden_layers - dense} MoE"
    lines = [
        *harness.report_header(
            f"Serving a {name}-shaped model on {header['device']}",
            {
                "model": f"{name} widths, {cfg.num_hidden_layers} layers ({layers}), "
                f"random weights (--load-format dummy --quantization {args.quantization})",
                "weights per device": f"{runs[0]['weights_gib']:.2f} GiB loaded (the server's log), "
                f"{planned / 2**30:.2f} GiB planned (jaxdsa.plan), "
                f"{100 * (runs[0]['weights_gib'] * 2**30 / planned - 1):+.1f} %",
                "workload": "jaxdsa.serve.bench: "
                + (
                    f"{args.requests_per_stream} requests per stream (at least 3) per level"
                    if args.requests_per_stream
                    else f"{args.num_prompts} prompts/level"
                )
                + f", {args.input_len} tokens in, {args.output_len} out, ignore_eos, streaming",
                "server": f"python -m serve --max-num-seqs {max(r['concurrency'] for r in table)} "
                f"--max-num-batched-tokens {args.max_num_batched_tokens} "
                f"--max-model-len {args.max_model_len} --kv-cache-dtype {args.kv_cache_dtype} "
                "(buckets compiled at start-up; no environment "
                "variables, --gpu-memory-utilization at its default)"
                + _parallel_flags(par)
                + (f" {args.server_args}" if args.server_args else ""),
                **ceilings.rows(),
                **{
                    f"server start to /health ({run['scheduling']} scheduling)": f"{run['startup']:.0f} s"
                    for run in runs
                },
            },
        ),
        "async: the engine launches each step before the last one's tokens reach the host (the default);",
        "sync: --no-async-scheduling, each step launched after the last one's tokens were processed.",
        "Per-stream decode tok/s = 1 / mean inter-token latency; aggregate = per-stream x concurrency.",
        "Roofline = bytes one decode step must read (jaxdsa.plan.decode_step: weights touched at their",
        f"stored width + the cache of a {context:.0f}-token context per sequence; routed experts per MoE",
        "layer at their expected count under uniform routing, E * (1 - (1 - k/E)^batch), + the shared",
        "one) / memory ceiling;",
        "% of roofline = roofline step time / measured mean ITL. Output tok/s is jaxdsa.serve.bench's, as",
        "measured (all output tokens over the level's wall time, prefill included).",
        "",
        harness.markdown_table(table, cols),
        "",
    ]
    for run in runs:
        if run["anatomy"] is not None:
            lines += [
                f"Decode anatomy of one stream ({run['scheduling']} scheduling; a trace through "
                f"/start_profile and /stop_profile of one {args.profile_steps}-token request, GPU 0; "
                "benchmarks.anatomy):",
                "",
                "```",
                *anatomy.lines(run["anatomy"]),
                "```",
                "",
            ]
    anatomies = {run["scheduling"]: run["anatomy"] for run in runs if run["anatomy"]}
    path = harness.write_result("serve", "\n".join(lines), suffix=args.suffix, rows=table)
    if anatomies:
        payload = json.loads(path.with_suffix(".json").read_text())
        harness.dump_json(str(path.with_suffix(".json")), payload | {"anatomy": anatomies})
    print("\n".join(lines))
    print(f"serve_gpu: wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
