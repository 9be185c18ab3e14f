"""``python -m serve [MODEL] [vLLM-style flags]``: load a checkpoint, compile, serve the OpenAI API.

The flags are vLLM's names for the same things (and SGLang's, where it names them otherwise), so a
``vllm serve`` or ``sglang.launch_server`` command line works with ``python -m serve`` in its place;
their flags that mean nothing here are ignored with a warning, and those asking for what jaxdsa
does not do are refused by name (:mod:`jaxdsa.serve.foreign_flags`). MODEL is a checkpoint directory or a
Hub id already in the local Hugging Face cache; without it the bundled tiny GLM-5 model
(``jaxdsa.serve.default_model``) is served. Bad input (unknown model, impossible flag combination) exits
with status 2 and one clear line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI

import jaxdsa
from jaxdsa.cache import kv_cache_format
from jaxdsa.engine import AsyncEngine, SpeculativeConfig, memory
from jaxdsa.kv_transfer.agent import TransferError
from jaxdsa.kv_transfer.config import KVTransferConfig
from jaxdsa.kv_transfer.connector import KVConnector
from jaxdsa.loading import device_param_bytes
from jaxdsa.serve import default_model, foreign_flags
from jaxdsa.serve.app import ServingContext, create_app
from jaxdsa.serve.chat_format import JinjaChatFormat, load_chat_format
from jaxdsa.serve.reasoning import REASONING_PARSERS
from jaxdsa.serve.tokenizer import Tokenizer
from jaxdsa.serve.tool_parsers import TOOL_PARSERS
from jaxdsa.text import generation_defaults

ENABLE_EXPERT_PARALLEL = object()  # what a bare -ep parses to (vLLM's short --enable-expert-parallel)


class StartupError(Exception):
    """A problem with the command line or the model that stops the server from starting (exit 2)."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve",
        allow_abbrev=False,  # vLLM's --tokenizer must not pass for --tokenizer-mode
        description="OpenAI-compatible server for GLM-5.x / DeepSeek-V3.2 / DeepSeek-V4 on jaxdsa.",
    )
    p.add_argument(
        "model",
        nargs="?",
        help="checkpoint directory or Hub id in the local HF cache (default: the bundled tiny GLM-5)",
    )
    p.add_argument("--model", "--model-path", dest="model_flag", metavar="MODEL", help="MODEL, as a flag")
    p.add_argument(
        "--tokenizer", help="accepted when it names MODEL itself; the checkpoint's tokenizer.json is used"
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", nargs="+", help="name(s) clients use in 'model' (default: MODEL as given)"
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the API routes")
    g = p.add_argument_group("engine")
    g.add_argument(
        "--max-model-len",
        "--context-length",
        type=int,
        help="prompt + output tokens per request (default: min(max_position_embeddings, 8192))",
    )
    g.add_argument(
        "--max-num-seqs", "--max-running-requests", type=int, default=16, help="requests decoded together"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        "--chunked-prefill-size",
        type=int,
        default=512,
        help="tokens per engine step (prefill chunk budget)",
    )
    g.add_argument(
        "--page-size",
        "--block-size",
        dest="page_size",
        type=int,
        help="cache page size in tokens (default: the model's, 64; DeepSeek-V4: 128)",
    )
    g.add_argument(
        "--num-pages", type=int, help="cache pages (default: what --gpu-memory-utilization leaves for it)"
    )
    g.add_argument(
        "--gpu-memory-utilization",
        "--mem-fraction-static",
        type=float,
        default=memory.DEFAULT_UTILIZATION,
        help="share of each GPU for weights, cache and step activations (the rest is left to others); "
        "a model whose weights and one --max-model-len sequence do not fit is refused before loading",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="launch each step before the last one's tokens reach the host, so the GPU never waits "
        "for the scheduler (outputs unchanged; steps with speculative decoding run synchronously)",
    )
    g.add_argument(
        "--max-queue-len",
        type=int,
        default=256,
        help="requests waiting beyond --max-num-seqs before new ones get HTTP 429",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="auto: float32 checkpoints in float32, else bfloat16",
    )
    g.add_argument(
        "--max-logprobs", type=int, default=20, help="most top logprobs a request may ask for per token"
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the cache pages of token prefixes computed before (chat history, system prompts)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed for requests that give none (and for --load-format dummy)"
    )
    g.add_argument(
        "--load-format",
        choices=["safetensors", "dummy"],
        default="safetensors",
        help="dummy: random weights of the config's shapes, made on the device (benchmarks)",
    )
    g.add_argument(
        "--quantization",
        choices=["auto", "dequantize", "fp8", "int4", "nvfp4", "modelopt_fp4", "ascend"],
        default="auto",
        help="auto: keep the checkpoint's FP8 / INT4 / NVFP4 weights quantized on the device; dequantize: "
        "load them dense; fp8 / int4 / nvfp4: assert the checkpoint's format, or choose the --load-format "
        "dummy one; modelopt_fp4 (vLLM's name for ModelOpt NVFP4): nvfp4; ascend (vLLM-Ascend's): taken "
        "as auto, with a warning",
    )
    g.add_argument(
        "--kv-transfer-config",
        help='JSON, as vLLM: {"kv_connector": "NixlConnector", "kv_role": "kv_producer" | "kv_consumer" | '
        '"kv_both"} makes this server a prefill or decode instance of disaggregated serving (a request\'s '
        "cache moves between servers through NIXL; put `python -m serve.router` in front)",
    )
    g.add_argument(
        "--speculative-config",
        help='JSON, as vLLM: {"method": "mtp", "num_speculative_tokens": N} drafts N tokens per step (1-5) '
        "with the checkpoint's next-n (MTP) layers and verifies them in one step",
    )
    g.add_argument(
        "--num-gpu-experts",
        "--kt-num-gpu-experts",
        type=int,
        help="routed experts per MoE layer kept on the GPUs; the others live in host RAM, in their "
        "checkpoint format, and run on the CPU inside the step (default: all on the GPUs)",
    )
    g.add_argument(
        "--gpu-experts-policy",
        choices=["uniform", "frequency"],
        default="uniform",
        help="which experts stay on the GPUs: spread evenly, or the most-routed of --expert-stats",
    )
    g.add_argument("--expert-stats", help="JSON routing counts per MoE layer, for the frequency policy")
    g.add_argument(
        "--record-expert-stats",
        metavar="FILE",
        help="count each MoE layer's routing and write it to FILE at exit, in --expert-stats' format "
        "(a profiling mode: a host round trip per layer)",
    )
    g.add_argument(
        "--cpu-threads",
        "--kt-cpuinfer",
        type=int,
        help="threads of the host experts' CPU kernel (default: half the cores)",
    )
    g.add_argument(
        "--disable-shared-experts-fusion",
        action="store_true",
        help="run each MoE layer's shared expert apart, not as one more routed expert in their kernels",
    )
    g.add_argument(
        "--no-warmup", action="store_true", help="compile step shapes on first use instead of at startup"
    )
    g.add_argument("--tensor-parallel-size", "-tp", "--tp-size", "--tp", type=int, default=1)
    g.add_argument(
        "--expert-parallel-size",
        "-ep",
        "--ep-size",
        "--ep",
        type=int,
        nargs="?",
        const=ENABLE_EXPERT_PARALLEL,
        help="expert shards (default 1); -ep alone is vLLM's short --enable-expert-parallel",
    )
    g.add_argument("--data-parallel-size", "-dp", "--dp-size", "--dp", type=int, default=1)
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="vLLM's expert parallelism: the routed experts split over every GPU (ep = tp x dp), the "
        "data-parallel groups' attention apart (dp attention when dp > 1)",
    )
    g.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="the data-parallel groups share the routed experts (split over all of them; "
        "--expert-parallel-size counts every shard), as in SGLang",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model's dtype, also accepted by its name) or fp8 (= fp8_e4m3, fp8_ds_mla: "
        "GLM-5.x / V3.2 latent rows in 656 bytes and e4m3 index keys, as the released engines store them)",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM compatibility; jaxdsa never runs checkpoint code",
    )
    g.add_argument(
        "--profile-dir",
        help="enable POST /start_profile and /stop_profile (vLLM's), writing jax.profiler traces here",
    )
    g = p.add_argument_group("chat")
    g.add_argument(
        "--chat-template",
        help="a Jinja chat template (a file, or the template itself) instead of the checkpoint's",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        help="where default sampling parameters come from: auto (the checkpoint's "
        "generation_config.json), vllm (none: the API's defaults), or a directory holding one",
    )
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS))
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS))
    g.add_argument(
        "--enable-auto-tool-choice", action="store_true", help='parse tool calls when tool_choice is "auto"'
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    g.add_argument("--disable-log-requests", action="store_true", help="no access-log line per request")
    foreign_flags.add_arguments(p)
    return p


def _log(message: str) -> None:
    print(f"jaxdsa: {message}", file=sys.stderr, flush=True)


def resolve_model_dir(model: str) -> str:
    """A local directory, or the snapshot of a Hub id in the Hugging Face cache (no downloads)."""
    if os.path.isdir(model):
        return model
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub"
    )
    repo = os.path.join(hub, "models--" + model.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as fh:
            snapshot = os.path.join(repo, "snapshots", fh.read().strip())
    except OSError:
        snapshot = ""
    if os.path.isdir(snapshot):
        return snapshot
    raise StartupError(
        f"model {model!r} is neither a directory nor in the Hugging Face cache at {hub} "
        "(jaxdsa does not download; fetch it first)"
    )


def _checkpoint_json(model_dir: str, name: str) -> dict[str, Any]:
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _dtype(requested: str, config: dict[str, Any]) -> str:
    if requested != "auto":
        return requested
    return "float32" if config.get("dtype", config.get("torch_dtype")) == "float32" else "bfloat16"


def _parallelism(args: argparse.Namespace) -> dict[str, int | bool]:
    """The parallelism for jaxdsa.LLM (which checks it against the devices). vLLM's
    ``--enable-expert-parallel`` splits the experts over all tp x dp GPUs, each dp group keeping its
    own attention: jaxdsa's ep = tp x dp with dp attention."""
    tp, dp, ep = args.tensor_parallel_size, args.data_parallel_size, args.expert_parallel_size
    if ep is ENABLE_EXPERT_PARALLEL:
        args.enable_expert_parallel, ep = True, None
    if not args.enable_expert_parallel:
        return {"tp": tp, "ep": 1 if ep is None else ep, "dp": dp, "dp_attention": args.enable_dp_attention}
    if ep is not None and ep != tp * dp:
        raise StartupError(
            f"--enable-expert-parallel splits the experts over tp x dp = {tp * dp} GPUs; "
            f"--expert-parallel-size {ep} says otherwise (give one of the two)"
        )
    return {"tp": tp, "ep": tp * dp, "dp": dp, "dp_attention": dp > 1 or args.enable_dp_attention}


def _check_flags(args: argparse.Namespace) -> dict[str, int | bool]:
    """Flags that cannot work; returns the parallelism (:func:`_parallelism`). Settles the flags
    that say one thing two ways: ``args.model`` from ``--model``, ``--quantization ascend`` as auto,
    ``modelopt_fp4`` as nvfp4."""
    refused = foreign_flags.check(args, _log)
    if refused:
        raise StartupError(refused)
    if args.model_flag and args.model and args.model_flag != args.model:
        raise StartupError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    args.model = args.model or args.model_flag
    if args.tokenizer is not None and args.tokenizer != args.model:
        raise StartupError(
            f"--tokenizer {args.tokenizer}: a tokenizer other than the checkpoint's is not supported"
        )
    if args.trust_remote_code:
        _log("--trust-remote-code accepted: jaxdsa runs no code from checkpoints")
    if args.quantization == "ascend":
        _log("--quantization ascend taken as auto: the checkpoint's own format (NPU-only ones are refused)")
        args.quantization = "auto"
    if args.quantization == "modelopt_fp4":
        args.quantization = "nvfp4"
    try:
        SpeculativeConfig.parse(args.speculative_config)
    except ValueError as e:
        raise StartupError(f"--speculative-config: {e}") from None
    try:
        args.kv_transfer = (
            KVTransferConfig.parse(args.kv_transfer_config) if args.kv_transfer_config else None
        )
    except ValueError as e:
        raise StartupError(f"--kv-transfer-config: {e}") from None
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise StartupError("--enable-auto-tool-choice needs --tool-call-parser")
    for flag in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise StartupError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_queue_len < 0:
        raise StartupError("--max-queue-len must be >= 0")
    if args.max_logprobs < 0:
        raise StartupError("--max-logprobs must be >= 0")
    try:
        memory.check_utilization(args.gpu_memory_utilization)
    except ValueError as e:
        raise StartupError(f"--gpu-memory-utilization: {e}") from None
    if args.generation_config not in ("auto", "vllm"):
        if not os.path.isdir(args.generation_config):
            raise StartupError(
                f"--generation-config: {args.generation_config!r} is not auto, vllm or a directory"
            )
        try:  # read now, not after minutes of loading
            _generation_defaults(args.generation_config, "")
        except (OSError, ValueError) as e:
            raise StartupError(f"--generation-config: {e}") from None
    return _parallelism(args)


def _check_kv_cache_dtype(requested: str, dtype: str) -> None:
    """``auto``, the model's dtype by name, or fp8 (:func:`jaxdsa.cache.kv_cache_format`), checked
    before minutes of loading."""
    try:
        kv_cache_format(requested, dtype)
    except ValueError as e:
        raise StartupError(f"--kv-cache-dtype: {e}") from None


def _chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's text, or the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    if "{{" in value or "{%" in value:
        return value
    raise StartupError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def _generation_defaults(setting: str, model_dir: str) -> dict[str, Any]:
    """Default sampling parameters by --generation-config: the checkpoint's, none, or a directory's."""
    if setting == "vllm":
        return {}
    if setting != "auto" and not os.path.isfile(os.path.join(setting, "generation_config.json")):
        raise ValueError(f"no generation_config.json in {setting}")
    return generation_defaults(model_dir if setting == "auto" else setting)


def _features(args: argparse.Namespace, engine, parallel: dict[str, int | bool]) -> list[str]:
    """What the server does beyond plain decoding, for the start-up log."""
    cfg = engine.config
    on = [
        f"{'async' if cfg.async_scheduling else 'synchronous'} scheduling",
        f"memory budget {args.gpu_memory_utilization:g} of each GPU",
        "tp {tp} ep {ep} dp {dp}".format(**parallel) + " with dp attention" * bool(parallel["dp_attention"]),
    ]
    if cfg.speculative is not None:
        on.append(f"MTP speculative decoding, {cfg.speculative.num_speculative_tokens} drafts per step")
    if cfg.enable_prefix_caching:
        on.append("prefix caching")
    if args.reasoning_parser:
        on.append(f"reasoning parser {args.reasoning_parser}")
    if args.tool_call_parser:
        auto = " (auto tool choice)" if args.enable_auto_tool_choice else ""
        on.append(f"tool-call parser {args.tool_call_parser}{auto}")
    if args.chat_template:
        on.append("chat template from --chat-template")
    if args.kv_transfer is not None:
        kv = args.kv_transfer
        on.append(f"disaggregated serving as {kv.kv_role}, engine id {kv.engine_id} (cache moved by NIXL)")
    return on


@dataclasses.dataclass
class Server:
    app: FastAPI
    engine: AsyncEngine
    context: ServingContext


def build(args: argparse.Namespace) -> Server:
    """Load the model, compile (unless --no-warmup), start the engine thread; StartupError on bad input."""
    parallel = _check_flags(args)
    if args.model:
        model_dir, names = resolve_model_dir(args.model), args.served_model_name or [args.model]
    else:
        _log(
            "no model given: serving the bundled tiny GLM-5 model (random weights) "
            f"from {default_model.cache_root()}"
        )
        model_dir, names = (
            default_model.ensure_default_model(),
            args.served_model_name or [default_model.NAME],
        )
    try:
        model_type = jaxdsa.load_config(model_dir).model_type
        tokenizer = Tokenizer(model_dir)
        if args.chat_template:
            chat_format = JinjaChatFormat(_chat_template(args.chat_template), tokenizer.special_tokens_map)
        else:
            chat_format = load_chat_format(
                model_dir, model_type, tokenizer.config, tokenizer.special_tokens_map
            )
        dtype = _dtype(args.dtype, _checkpoint_json(model_dir, "config.json"))
        _check_kv_cache_dtype(args.kv_cache_dtype, dtype)
        _log(f"loading {model_dir} ({model_type}, {dtype})")
        start = time.perf_counter()
        llm = jaxdsa.LLM(
            model_dir,
            dtype=dtype,
            page_size=args.page_size,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_pages=args.num_pages,
            max_logprobs=args.max_logprobs,
            enable_prefix_caching=args.enable_prefix_caching,
            seed=args.seed,
            load_format=args.load_format,
            quantization=args.quantization,
            speculative_config=args.speculative_config,
            gpu_memory_utilization=args.gpu_memory_utilization,
            async_scheduling=args.async_scheduling,
            num_gpu_experts=args.num_gpu_experts,
            gpu_experts_policy=args.gpu_experts_policy,
            expert_stats=args.expert_stats,
            cpu_threads=args.cpu_threads,
            record_expert_stats=args.record_expert_stats,
            fuse_shared_experts=not args.disable_shared_experts_fusion,
            **parallel,
        )
        engine = llm.engine
    except (ValueError, OSError, ImportError) as e:  # ConfigError / CheckpointError are ValueErrors
        raise StartupError(str(e)) from e
    weights = max(device_param_bytes(llm.model).values()) / 2**30
    _log(
        f"loaded in {time.perf_counter() - start:.1f}s; weights {weights:.2f} GiB per device; "
        f"max_model_len {engine.max_model_len}, cache {engine.stats()['cache_pages_total']} pages of "
        f"{llm.page_size} ({'fp8' if engine.runner.kv_format == 'fp8' else dtype} rows); "
        f"{'async' if engine.config.async_scheduling else 'synchronous'} scheduling"
    )
    if not args.no_warmup:
        kv = args.kv_transfer
        engine.warmup(progress=True, export=bool(kv and kv.produces), load=bool(kv and kv.consumes))
    defaults = _generation_defaults(args.generation_config, model_dir)
    if defaults:
        _log(f"default sampling from generation_config.json: {defaults}")
    for feature in _features(args, engine, parallel):
        _log(f"on: {feature}")
    kv = None
    if args.kv_transfer is not None:
        try:
            kv = KVConnector(args.kv_transfer)
        except (ImportError, TransferError) as e:
            raise StartupError(f"--kv-transfer-config: {e}") from e
    aengine = AsyncEngine(engine, max_waiting=args.max_queue_len, profile_dir=args.profile_dir)
    aengine.start()
    context = ServingContext(
        generate=aengine.generate,
        stats=engine.stats if kv is None else lambda: engine.stats() | kv.stats.as_metrics(),
        tokenizer=tokenizer,
        chat_format=chat_format,
        model_names=names,
        max_model_len=engine.max_model_len,
        eos_token_ids=frozenset(llm.eos_token_ids),
        model_path=model_dir,
        reasoning_parser=args.reasoning_parser,
        tool_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        default_sampling=defaults,
        api_key=args.api_key,
        max_logprobs=args.max_logprobs,
        vocab_size=llm.config.vocab_size,
        alive=aengine.is_alive,
        profiler=aengine if args.profile_dir else None,
        kv=kv,
    )
    return Server(create_app(context), aengine, context)


def bind(host: str, port: int) -> socket.socket:
    """Claim the port before the slow model load, so a busy port fails at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from e
    return sock


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    sock = None
    try:
        sock = bind(args.host, args.port)
        server = build(args)
    except StartupError as e:
        if sock is not None:
            sock.close()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    host, port = sock.getsockname()[:2]
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    _log(f"ready: serving {server.context.model_names[0]!r} at http://{shown}:{port}/v1")
    config = uvicorn.Config(
        server.app,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
        access_log=not args.disable_log_requests,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown; that is a normal exit
        pass
    finally:
        server.engine.shutdown()
        if server.context.kv is not None:
            server.context.kv.close()
