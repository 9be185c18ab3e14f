"""The notebook API: ``jaxdsa.LLM(path)``, its ``.model``, ``.score(ids)``, ``.generate(prompts)``
and ``.chat(messages)``.

``model`` is the Flax NNX module tree: print it, index a layer (``model.layer(3)``), replace a
submodule, call it. ``score`` is one full forward of a single sequence over the current module
tree. ``generate`` and ``chat`` run on the serving engine: the prompts are served concurrently with
continuous batching, chunked prefill and the paged cache, exactly as the HTTP server serves them.
Token-id prompts give new token ids; text prompts (or a :class:`jaxdsa.SamplingParams`) and chat
give vLLM's :class:`~jaxdsa.text.RequestOutput`, whose text is what the server would send for the
same request (the same tokenizer, chat formats, stop strings and reply parsers, from ``jaxdsa.serve``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import json
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdsa import sharding, text
from jaxdsa.engine import Engine, EngineConfig, RequestOutput, SamplingParams, memory
from jaxdsa.engine.engine import CacheLayout, enable_compilation_cache
from jaxdsa.engine.speculative import SpeculativeConfig
from jaxdsa.loading import load_model
from jaxdsa.models.registry import family_for, load_config
from jaxdsa.offload import ExpertPlacement
from jaxdsa.offload.stats import ExpertStats
from jaxdsa.quantized_weight import QuantizedWeight

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def generation_eos_ids(path: str | os.PathLike, default: Sequence[int]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what HF generate stops on), else the config's."""
    file = os.path.join(path, "generation_config.json")
    if os.path.exists(file):
        with open(file, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token_id", default)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (eos,)
    return tuple(default)


def _quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


class LLM:
    """A GLM-5.x / DeepSeek-V3.2 / DeepSeek-V4 checkpoint ready to score and generate.

    ``tp`` / ``ep`` / ``dp``: tensor, expert and data parallelism over the local devices
    (see :mod:`jaxdsa.sharding`); ``dp_attention``: the dp groups share the experts (``ep``
    counts the shards over all of them). Weights load straight into their sharded layout.
    ``max_logprobs``: the most top logprobs a request served by :attr:`engine` may ask for;
    ``enable_prefix_caching``: its requests reuse the cache pages of token prefixes computed before
    (not for DeepSeek-V4, whose per-sequence rings the pages do not hold). ``page_size``: cache page
    size in tokens (vLLM's block size; default the family's: 64, DeepSeek-V4 128, which needs a
    multiple of its compression ratios).
    ``reasoning_parser`` / ``tool_call_parser``: the parsers :meth:`chat` splits replies with (the
    server's ``--reasoning-parser`` / ``--tool-call-parser`` names; default the family's, set None to
    parse nothing).
    ``scan_layers``: stack layers of one kind and run them under ``lax.scan`` (compile time
    independent of depth; the default), or ``False``: one module per layer, unrolled. Scanned, the
    weights the Pallas kernels read (routed experts, quantized linears) reach them as whole stacks
    with the traced layer index, so XLA never copies a layer's slice out of a stack for a kernel
    (see :mod:`jaxdsa.models.layer_groups`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        dtype: str = "bfloat16",
        *,
        tp: int = 1,
        ep: int = 1,
        dp: int = 1,
        dp_attention: bool = False,
        page_size: int | None = None,
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        num_pages: int | None = None,
        max_logprobs: int = 20,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        load_format: str = "safetensors",
        progress: bool = True,
        scan_layers: bool = True,
        quantization: str = "auto",
        speculative_config: str | dict | SpeculativeConfig | None = None,
        gpu_memory_utilization: float = memory.DEFAULT_UTILIZATION,
        async_scheduling: bool = True,
        num_gpu_experts: int | None = None,
        gpu_experts_policy: str = "uniform",
        expert_stats: str | os.PathLike | None = None,
        cpu_threads: int | None = None,
        record_expert_stats: str | os.PathLike | None = None,
        fuse_shared_experts: bool = True,
    ):
        """``load_format="dummy"``: random weights of the checkpoint's config, made on the device
        (benchmarking real shapes without the files, like vLLM's ``--load-format dummy``).
        ``quantization``: ``"auto"`` keeps the checkpoint's FP8 / INT4 / NVFP4 linears and experts in
        their format on the device, ``"dequantize"`` makes every weight dense in ``dtype``, ``"fp8"`` /
        ``"int4"`` / ``"nvfp4"`` assert the checkpoint's format or choose the dummy weights' (see
        :mod:`jaxdsa.quantization`). ``speculative_config``: vLLM's, e.g. ``{"method": "mtp",
        "num_speculative_tokens": 3}``: the engine drafts with the checkpoint's next-n layers and
        verifies the drafts in one step (greedy output unchanged, sampling distribution preserved).
        ``gpu_memory_utilization``: the share of each GPU jaxdsa takes for weights, cache and steps
        (vLLM's; set before JAX starts, :mod:`jaxdsa.engine.memory`): a model whose weights and one
        ``max_model_len`` sequence do not fit in it is refused before any weight is read.
        ``async_scheduling``: the engine launches each step before the last one's tokens reach the
        host (vLLM's; outputs unchanged). ``num_gpu_experts``: routed experts per MoE layer kept on
        the GPUs, the others held in host RAM and computed on the CPU inside the step (default: all
        on the GPUs); ``gpu_experts_policy`` ``"uniform"`` or ``"frequency"`` (the most-routed ones
        of ``expert_stats``, a JSON file of routing counts); ``cpu_threads``: the host experts'
        kernel threads (default half the cores), see :mod:`jaxdsa.offload`. ``record_expert_stats``:
        a file the MoE layers' routing counts go to, in ``expert_stats``' format, written at exit
        and by ``self.expert_stats.write()`` (a profiling mode: :mod:`jaxdsa.offload.stats`).
        ``fuse_shared_experts``: each MoE layer's shared expert runs in the routed experts' kernels,
        as one more expert every token is routed to, where it can (:mod:`jaxdsa.shared_experts`;
        SGLang's shared-experts fusion; outputs unchanged up to rounding). ``kv_cache_dtype``:
        vLLM's; ``"auto"`` keeps the cache in ``dtype``, ``"fp8"`` stores it as the released engines
        do (GLM-5.x / V3.2: 656-byte ``fp8_ds_mla`` latent rows and e4m3 index keys, docs/models.md §5.8)."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: choose float32 or bfloat16")
        placement = ExpertPlacement.of(num_gpu_experts, gpu_experts_policy, expert_stats, cpu_threads)
        self.expert_stats = None if record_expert_stats is None else ExpertStats(record_expert_stats)
        memory.claim(gpu_memory_utilization)  # before the first JAX call starts the backend
        enable_compilation_cache()  # before loading, whose small placement jits are cached too
        self.path = os.fspath(path)
        self.dtype = _DTYPES[dtype]
        self.parallelism = sharding.Parallelism(tp=tp, ep=ep, dp=dp, dp_attention=dp_attention)
        self.mesh = sharding.make_mesh(self.parallelism) if self.parallelism.num_devices > 1 else None
        cfg = load_config(path)
        family = family_for(cfg.model_type)
        self.page_size = family.page_size(cfg, page_size)
        self.engine_config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            page_size=self.page_size,
            kv_cache_dtype=kv_cache_dtype,
            num_pages=num_pages,
            gpu_memory_utilization=gpu_memory_utilization,
            max_logprobs=max_logprobs,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            speculative=SpeculativeConfig.parse(speculative_config),
            async_scheduling=async_scheduling,
        )
        layout = CacheLayout.of(family, cfg, self.engine_config, self.dtype, self.mesh)

        def check_fits(weight_bytes: float) -> None:
            memory.check_fits(
                memory.device_memory(gpu_memory_utilization),
                weight_bytes=weight_bytes,
                minimum_cache_bytes=layout.minimum_bytes if num_pages is None else 0,
                what=f"{self.path} ({cfg.model_type}, {self.parallelism.num_devices} device(s))",
            )

        self.family, self.config, self.model = load_model(
            path,
            dtype=self.dtype,
            parallelism=self.parallelism if self.mesh is not None else None,
            mesh=self.mesh,
            load_format=load_format,
            seed=seed,
            progress=progress,
            scan_layers=scan_layers,
            quantization=quantization,
            check_weights=check_fits,
            placement=placement,
            expert_stats=self.expert_stats,
            fuse_shared_experts=fuse_shared_experts,
        )
        if self.expert_stats is not None:
            atexit.register(self.expert_stats.write)
        self.eos_token_ids = generation_eos_ids(self.path, self.config.eos_token_ids)
        self.reasoning_parser, self.tool_call_parser = text.FAMILY_PARSERS.get(cfg.model_type, (None, None))
        self._engine: Engine | None = None
        self._ids = itertools.count()

    def __repr__(self) -> str:
        """What a notebook wants to see of a loaded model: checkpoint, family and depth, the formats
        its weights are kept in, the mesh, and the cache once the engine has made it."""
        formats = sorted({w.format for w in jax.tree.leaves(nnx.state(self.model), is_leaf=_quantized)
                          if _quantized(w)})  # fmt: skip
        kept = f"{', '.join(formats)} ({jnp.dtype(self.dtype).name} elsewhere)" if formats else None
        par = self.parallelism
        mesh = f"tp {par.tp} ep {par.ep} dp {par.dp}" + " dp-attention" * par.dp_attention
        if self._engine is None:
            cache = "cache not made yet"
        else:
            cache = f"cache {self._engine.stats()['cache_pages_total']} pages of {self.page_size} tokens, "
            cache += f"max_model_len {self._engine.max_model_len}"
        return (
            f"LLM({self.path!r}: {self.config.model_type}, {self.config.num_hidden_layers} layers, "
            f"weights {kept or jnp.dtype(self.dtype).name}, {mesh}, {cache})"
        )

    def _precision(self):
        # float32 means float32: no TF32 matmuls on GPUs.
        return (
            jax.default_matmul_precision("highest") if self.dtype == jnp.float32 else contextlib.nullcontext()
        )

    @property
    def engine(self) -> Engine:
        """The serving engine over :attr:`model` as it was when the engine was first used."""
        if self._engine is None:
            self._engine = self.new_engine()
        return self._engine

    def new_engine(self, **changes: Any) -> Engine:
        """Another engine over the same weights, with :class:`EngineConfig` fields changed (e.g.
        ``speculative=``): for comparing engine settings on one loaded model. It has its own cache."""
        return Engine(
            self.family,
            self.config,
            self.model,
            dtype=self.dtype,
            eos_token_ids=self.eos_token_ids,
            config=dataclasses.replace(self.engine_config, **changes),
            mesh=self.mesh,
            precision=self._precision,
        )

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits [len(token_ids), vocab] (float32) of one full forward over the sequence, through
        the module tree as it is now (changes to :attr:`model` take effect).

        On a data-parallel mesh the sequence runs in dp group 0; the other groups get padding.
        """
        return self.engine.runner.score(self.model, token_ids, self.dtype)

    # -- text ----------------------------------------------------------------------------------
    @functools.cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer (``tokenizer.json``; the server's
        ``jaxdsa.serve.tokenizer.Tokenizer``)."""
        from jaxdsa.serve.tokenizer import Tokenizer

        return Tokenizer(self.path)

    @functools.cached_property
    def chat_format(self):
        """The family's chat format, as the server renders ``/v1/chat/completions`` (None when the
        checkpoint has no chat template)."""
        from jaxdsa.serve.chat_format import load_chat_format

        tok = self.tokenizer
        return load_chat_format(self.path, self.config.model_type, tok.config, tok.special_tokens_map)

    @functools.cached_property
    def default_sampling(self) -> dict[str, Any]:
        """Sampling defaults from generation_config.json (temperature, top_p, top_k), as the server's."""
        return text.generation_defaults(self.path)

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str | Mapping[str, Any]] | str,
        sampling_params: text.SamplingParams | SamplingParams | Sequence[Any] | None = None,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop_at_eos: bool | None = None,
        return_logits: bool = False,
    ):
        """Generate for every prompt, served concurrently through the engine.

        Text prompts (strings, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``), or any prompts
        with ``sampling_params`` (a :class:`jaxdsa.SamplingParams`, the engine's, or one per prompt),
        give vLLM's outputs: a :class:`~jaxdsa.text.RequestOutput` per prompt, its ``.outputs`` the
        ``n`` completions with ``.text``, ``.token_ids`` and ``.finish_reason``. Text is tokenized
        as ``/v1/completions`` does (with the tokenizer's special tokens); completions stop at EOS
        and at stop strings, and their text is what the server returns for the same request.

        Token-id prompts without ``sampling_params`` give the new token ids per prompt: greedy
        unless ``temperature`` (default 0); ``max_new_tokens`` (default 16) each, ``top_p`` /
        ``top_k`` filters, ``seed`` (prompt i samples with seed + i); they stop at EOS only with
        ``stop_at_eos``. With ``return_logits`` also returns, per prompt, the float32 logits
        [n_new, vocab] each new token was sampled from.
        """
        if isinstance(sampling_params, numbers.Number):
            raise TypeError(
                "generate(prompts, sampling_params): the second argument is a SamplingParams; "
                "pass max_new_tokens= / temperature= by name"
            )
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is not None or any(isinstance(p, str | Mapping) for p in prompts):
            legacy = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
            legacy |= dict(seed=seed, stop_at_eos=stop_at_eos, return_logits=return_logits or None)
            given = [k for k, v in legacy.items() if v is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: for token-id prompts only; text prompts take their sampling "
                    "in sampling_params=jaxdsa.SamplingParams(...)"
                )
            return self._generate_text([self._prompt(p) for p in prompts], sampling_params)
        sampling = [
            SamplingParams(
                max_tokens=16 if max_new_tokens is None else max_new_tokens,
                temperature=0.0 if temperature is None else temperature,
                top_p=1.0 if top_p is None else top_p,
                top_k=0 if top_k is None else top_k,
                seed=None if seed is None else seed + i,
                ignore_eos=not stop_at_eos,
            )
            for i in range(len(prompts))
        ]
        tokens: list[list[int]] = [[] for _ in prompts]
        logits: list[list[np.ndarray]] = [[] for _ in prompts]

        def collect(i: int, out: RequestOutput) -> bool:
            tokens[i] += out.new_token_ids
            if out.logits is not None:
                logits[i].append(out.logits)
            return False

        requests = [(f"llm-{next(self._ids)}", list(p), sp) for p, sp in zip(prompts, sampling)]
        self._serve(requests, collect, return_logits=return_logits)
        if return_logits:
            return tokens, [np.stack(x) for x in logits]
        return tokens

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: text.SamplingParams | SamplingParams | Sequence[Any] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[text.RequestOutput]:
        """Reply to one conversation (a list of OpenAI messages) or to each of a list of them, as
        ``/v1/chat/completions`` does: the messages checked and rendered by the family's chat format
        (``chat_template_kwargs``, e.g. ``{"enable_thinking": False}`` or ``{"thinking": False}``,
        which both switch thinking off for every family), generated, and parsed by
        :attr:`reasoning_parser` and (with ``tools``, tool choice "auto") :attr:`tool_call_parser`.
        Returns a :class:`~jaxdsa.text.RequestOutput` per conversation whose completions carry
        ``.text`` and ``.token_ids`` and the server's ``.content``, ``.reasoning_content``,
        ``.tool_calls`` and ``.message`` (append it to continue the conversation)."""
        try:
            from jaxdsa.serve.output import parser_markers, reply_parser
            from jaxdsa.serve.protocol import ChatCompletionRequest
        except ImportError as e:  # pydantic: the server's message checks
            raise ImportError(f"LLM.chat checks messages as the server does and needs {e.name}") from e
        if self.chat_format is None:
            raise ValueError(f"{self.path}: no chat template; use generate() with text")
        single = not messages or isinstance(messages[0], Mapping)
        conversations = [messages] if single else list(messages)
        prompts, parsing = [], []
        for conversation in conversations:
            body = ChatCompletionRequest.model_validate(
                {"messages": conversation, "tools": tools, "chat_template_kwargs": chat_template_kwargs}
            )
            tool_dicts = body.tool_dicts()
            prompt = self.chat_format.render(body.template_messages(), tool_dicts, body.template_kwargs())
            prompts.append((prompt.text, self.tokenizer.encode(prompt.text)))
            tool_parser = self.tool_call_parser if tool_dicts else None
            parsing.append(
                (
                    parser_markers(self.reasoning_parser, tool_parser),
                    functools.partial(
                        reply_parser, self.reasoning_parser, tool_parser, tool_dicts, prompt.thinking
                    ),
                )
            )
        return self._generate_text(prompts, sampling_params, parsing)

    def _prompt(self, prompt: str | Mapping[str, Any] | Sequence[int]) -> tuple[str | None, list[int]]:
        """(text, token ids) of a generate prompt; text is encoded as /v1/completions does."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, [int(t) for t in prompt]

    def _generate_text(
        self,
        prompts: list[tuple[str | None, list[int]]],
        sampling_params: Any,
        parsing: list[tuple[tuple[str, ...], Callable[[], Any]]] | None = None,
    ) -> list[text.RequestOutput]:
        """Serve (text, ids) prompts; ``parsing``: per prompt, the markers its reply parser needs
        kept in the text and a maker of that parser (chat)."""
        from jaxdsa.serve.output import ReplyDelta, text_output

        per_prompt = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(prompts)
        )
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling_params for {len(prompts)} prompts")
        eos = frozenset(self.eos_token_ids)
        results, choices, requests = [], [], []
        for i, ((prompt_text, ids), sp) in enumerate(zip(prompts, per_prompt)):
            sp = text.SamplingParams.of(sp)
            if not isinstance(sp.n, int) or sp.n < 1:
                raise ValueError(f"n must be an integer >= 1, not {sp.n!r}")
            room = self.engine.max_model_len - len(ids)
            if room < 1:
                limit = self.engine.max_model_len
                raise ValueError(f"prompt {i}: {len(ids)} tokens leave no room below max_model_len {limit}")
            engine_sp = text.engine_sampling(
                sp, self.default_sampling, room if sp.max_tokens is None else sp.max_tokens
            )
            request_id = f"llm-{next(self._ids)}"
            results.append(text.RequestOutput(request_id, prompt_text, ids, []))
            keep, make_parser = parsing[i] if parsing else ((), None)
            for j, spj in enumerate(text.choice_sampling(engine_sp, sp.n)):
                out = text.CompletionOutput(j, "", [], None, [] if spj.logprobs is not None else None)
                results[i].outputs.append(out)
                text_out = text_output(
                    self.tokenizer,
                    eos,
                    spj,
                    stop=sp.stop_strings,
                    skip_special_tokens=sp.skip_special_tokens,
                    keep=keep,
                )
                parser = make_parser() if make_parser else None
                choices.append((results[i], out, text_out, parser, ReplyDelta()))
                requests.append((f"{request_id}-{j}", ids, spj))

        def collect(k: int, engine_out: RequestOutput) -> bool:
            result, out, text_out, parser, reply = choices[k]
            out.token_ids += engine_out.new_token_ids
            if engine_out.logprobs is not None and out.logprobs is not None:
                out.logprobs += engine_out.logprobs
            if engine_out.prompt_logprobs is not None and result.prompt_logprobs is None:
                result.prompt_logprobs = engine_out.prompt_logprobs
            delta = text_out.push(engine_out)
            out.text += delta
            if parser is not None and delta:
                reply += parser.feed(delta)
            out.finish_reason = text_out.finish_reason(engine_out)
            return out.finish_reason is not None

        self._serve(requests, collect)
        for _, out, _, parser, reply in choices:
            if parser is not None:
                reply += parser.finish()
                out.finish_reason = parser.finish_reason(out.finish_reason)
                out.message = parser.message(reply)
                out.content = out.message["content"]
                out.reasoning_content = out.message.get("reasoning_content")
                out.tool_calls = out.message.get("tool_calls")
        return results

    def _serve(
        self,
        requests: list[tuple[str, list[int], SamplingParams]],
        on_output: Callable[[int, RequestOutput], bool],
        *,
        return_logits: bool = False,
    ) -> None:
        """Run (request id, prompt ids, sampling) requests concurrently on :attr:`engine`, calling
        ``on_output(k, output)`` for each engine output of request k; a True return ends request k
        there (a stop string: the engine's request is aborted). An engine error aborts them all
        and raises RuntimeError; so does any exception, after aborting them."""
        engine = self.engine
        index = {request_id: k for k, (request_id, _, _) in enumerate(requests)}
        done: set[str] = set()
        try:
            for request_id, prompt, sampling in requests:
                engine.add_request(request_id, list(prompt), sampling, return_logits=return_logits)
            while any(r in engine.requests for r in index):
                for out in engine.step():
                    k = index.get(out.request_id)
                    if k is None or out.request_id in done:
                        continue
                    if out.error is not None:
                        raise RuntimeError(f"prompt {k}: {out.error}")
                    if on_output(k, out) or out.finished:
                        done.add(out.request_id)
                        if not out.finished:  # ended by its text (a stop string): free it now
                            engine.abort(out.request_id)
        finally:
            for request_id in index:
                if request_id not in done:
                    engine.abort(request_id)
