"""Serving benchmark of a GLM-5-shaped model on one GPU: `python -m serve` + `serve.bench`.

The model has GLM-5's real layer widths (hidden 6144, 64 heads, MLA 2048/512/192+64/256,
indexer 32 x 128, top-2048, 256 experts top-8 x 2048, vocab 154880) and as many layers as one
H100 holds next to a useful cache: 3 dense + 2 MoE layers (about 46 GB of bf16 weights), with
random weights made on the device (``--load-format dummy``). The memory roofline counts what one
decode step of ``batch`` sequences must read: every weight the step touches (attention, indexer,
dense MLPs, the LM head, each MoE layer's router, shared expert and the routed experts it uses)
plus the latent cache rows of every sequence's context, divided by the memory ceiling measured in
the same run (the fastest of JAX's and torch's copy and read-only streams). Routed experts are
counted at their expected number under uniform routing, ``E * (1 - (1 - k/E) ** batch)`` (each
token picks k distinct experts of E): the most any routing of ``batch`` independent tokens touches
on average, so a step can beat the roofline only by touching fewer experts than uniform routing
would. (The earlier count, ``min(E, k * batch)``, is the most any batch can touch: at batch 32
it counted all 256 experts where uniform routing touches 163, and the table read 129 %.)

    python -m benchmarks.serve_gpu [--layers 5] [--input-len 512] [--output-len 64]

Writes benchmarks/results/serve-<gpu>.md (and the raw bench JSON beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks import harness
from checkpoints.tokenizer_assets import write_tokenizer
from jaxdsa.models.registry import config_from_dict

GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "rope_interleave": True,
    "indexer_rope_interleave": True,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


def write_model_dir(directory: str, layers: int, overrides: dict | None = None) -> dict:
    """config.json (GLM-5 widths, ``layers`` layers) + the GLM tokenizer files; no weights.

    The bundled tokenizer has 512 tokens; a random model samples from the whole vocabulary, so the
    BPE vocab is padded with filler tokens up to vocab_size (they decode to text but tokenization
    never produces them) and every streamed token carries text, as with a real tokenizer.
    """
    raw = {**GLM5, "num_hidden_layers": layers, "indexer_types": ["full"] * layers, **(overrides or {})}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(raw, fh, indent=1)
    write_tokenizer("glm_moe_dsa", directory, model_max_length=raw["max_position_embeddings"])
    path = os.path.join(directory, "tokenizer.json")
    with open(path, encoding="utf-8") as fh:
        tok = json.load(fh)
    vocab = tok["model"]["vocab"]
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})  # keeps their ids once the vocab grows
    vocab.update({f"<filler{i}>": i for i in range(max(vocab.values()) + 1, raw["vocab_size"])})
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(tok, fh)
    return raw


def expected_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts used by ``batch`` tokens that each pick ``top_k`` distinct experts
    uniformly at random: an expert is missed by one token with probability ``1 - top_k / n_experts``."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch)


def decode_step_bytes(raw: dict, context: int, batch: int = 1) -> float:
    """Bytes one decode step reads at ``batch`` sequences of ``context`` tokens (bf16 weights);
    routed experts at :func:`expected_experts`."""
    c = config_from_dict(raw)
    D, H, bf16 = c.hidden_size, c.num_attention_heads, 2
    attn = D * c.q_lora_rank + c.q_lora_rank * H * c.qk_head_dim + D * c.latent_dim
    attn += H * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank + H * c.v_head_dim * D
    indexer = (
        c.q_lora_rank * c.index_n_heads * c.index_head_dim + D * c.index_head_dim + 2 * D * c.index_n_heads
    )  # weights_proj is fp32
    dense = 3 * D * c.intermediate_size
    expert = 3 * D * c.moe_intermediate_size
    total = 0.0
    for layer in range(c.num_hidden_layers):
        total += attn + (indexer if c.has_indexer(layer) else 0)
        if c.is_moe_layer(layer):
            touched = expected_experts(c.n_routed_experts, c.num_experts_per_tok, batch)
            total += D * c.n_routed_experts + (touched + c.n_shared_experts) * expert
        else:
            total += dense
    total += D * c.vocab_size  # LM head
    kv_rows = min(context, c.index_topk)  # sparse attention reads at most index_topk rows
    kv = c.num_hidden_layers * kv_rows * c.latent_dim
    if context > c.index_topk:
        kv += len(c.indexer_layers) * context * c.index_head_dim  # the indexer scans every key
    return (total + batch * kv) * bf16


def _wait_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"serve not healthy after {timeout:.0f}s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", default="1,4,8,16,32")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument(
        "--overrides", default="{}", help="JSON config overrides (CPU smoke tests use small widths)"
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--torch-ceilings", action="store_true", help="measure torch's streams too")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="glm5-shaped-")
    raw = write_model_dir(work, args.layers, json.loads(args.overrides))
    url = f"http://127.0.0.1:{args.port}"
    levels = [int(c) for c in args.concurrency.split(",")]
    cmd = [
        sys.executable,
        "-m",
        "serve",
        work,
        "--load-format",
        "dummy",
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
        "glm5-shaped",
    ]
    start = time.time()
    server = subprocess.Popen(cmd)
    try:
        _wait_health(url, server, timeout=600)
        startup = time.time() - start
        out_json = os.path.join(work, "bench.json")
        bench = [
            sys.executable,
            "-m",
            "serve.bench",
            "--url",
            url,
            "--concurrency",
            args.concurrency,
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--num-prompts",
            str(args.num_prompts),
            "--json",
            out_json,
        ]
        subprocess.run(bench, check=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    rows = json.load(open(out_json))["results"]
    # Only now touch the GPU from this process (the server is gone): the ceilings, torch's too.
    _report(rows, raw, args, harness.measure_ceilings(torch_peers=args.torch_ceilings), startup)
    return 0


def _report(rows, raw, args, ceilings: harness.Ceilings, startup: float) -> None:
    context = args.input_len + args.output_len / 2
    header = harness.device_header()
    table = []
    for r in rows:
        itl = r["itl_ms"]["mean"]
        per_stream = 1000.0 / itl if itl == itl and itl > 0 else float("nan")
        row = {
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
        step_bytes = decode_step_bytes(raw, int(context), r["concurrency"])
        row["routed experts/layer"] = expected_experts(
            raw["n_routed_experts"], raw["num_experts_per_tok"], r["concurrency"]
        )
        row["bytes/step GB"] = step_bytes / 1e9
        row["roofline ms"] = step_bytes / (ceilings.stream_gbs * 1e9) * 1e3
        row["% of roofline"] = 100 * row["roofline ms"] / itl if itl == itl else float("nan")
        table.append(row)
    cols = list(table[0])
    moe_layers = raw["num_hidden_layers"] - raw["first_k_dense_replace"]
    lines = [
        *harness.report_header(
            f"Serving a GLM-5-shaped model on {header['device']}",
            {
                "model": f"GLM-5 widths, {raw['num_hidden_layers']} layers "
                f"({raw['first_k_dense_replace']} dense + {moe_layers} MoE), "
                "random bf16 weights (--load-format dummy)",
                "workload": f"serve.bench: {args.num_prompts} prompts/level, {args.input_len} tokens in, "
                f"{args.output_len} out, ignore_eos, streaming",
                "server": f"python -m serve --max-num-seqs {max(r['concurrency'] for r in rows)} "
                f"--max-num-batched-tokens {args.max_num_batched_tokens} "
                f"--max-model-len {args.max_model_len} (buckets compiled at start-up)",
                **ceilings.rows(),
                "server start to /health": f"{startup:.0f} s",
            },
        ),
        "Per-stream decode tok/s = 1 / mean inter-token latency; aggregate = per-stream x concurrency.",
        "Roofline = bytes one decode step must read (weights touched + latent cache of a",
        f"{context:.0f}-token context per sequence; routed experts per MoE layer at their expected count",
        "under uniform routing, 256 * (1 - (1 - 8/256)^batch), + the shared one) / memory ceiling;",
        "% of roofline = roofline step time / measured mean ITL. Output tok/s is serve.bench's, as",
        "measured (all output tokens over the level's wall time, prefill included).",
        "",
        harness.markdown_table(table, cols),
        "",
    ]
    path = harness.write_result("serve", "\n".join(lines), rows=table)
    print("\n".join(lines))
    print(f"serve_gpu: wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
