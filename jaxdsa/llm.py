"""The notebook API: ``jaxdsa.LLM(path)``, its ``.model``, ``.score(ids)`` and ``.generate(prompts)``.

``model`` is the Flax NNX module tree: print it, index a layer (``model.layer(3)``), replace a
submodule, call it. ``score`` is one full forward of a single sequence over the current module
tree. ``generate`` runs on the serving engine: the prompts are served concurrently with
continuous batching, chunked prefill and the paged cache, exactly as the HTTP server serves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdsa import sharding
from jaxdsa.engine import Engine, EngineConfig, SamplingParams, memory
from jaxdsa.engine.engine import CacheLayout
from jaxdsa.engine.speculative import SpeculativeConfig
from jaxdsa.loading import load_model
from jaxdsa.models.registry import family_for, load_config
from pallas_kernels.quant_matmul.layout import QuantizedWeight

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
    ):
        """``load_format="dummy"``: random weights of the checkpoint's config, made on the device
        (benchmarking real shapes without the files, like vLLM's ``--load-format dummy``).
        ``quantization``: ``"auto"`` keeps the checkpoint's FP8 / INT4 linears and experts in their
        format on the device, ``"dequantize"`` makes every weight dense in ``dtype``, ``"fp8"`` /
        ``"int4"`` assert the checkpoint's format or choose the dummy weights' (see
        :mod:`jaxdsa.quantization`). ``speculative_config``: vLLM's, e.g. ``{"method": "mtp",
        "num_speculative_tokens": 3}``: the engine drafts with the checkpoint's next-n layers and
        verifies the drafts in one step (greedy output unchanged, sampling distribution preserved).
        ``gpu_memory_utilization``: the share of each GPU jaxdsa takes for weights, cache and steps
        (vLLM's; set before JAX starts, :mod:`jaxdsa.engine.memory`): a model whose weights and one
        ``max_model_len`` sequence do not fit in it is refused before any weight is read.
        ``async_scheduling``: the engine launches each step before the last one's tokens reach the
        host (vLLM's; outputs unchanged)."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: choose float32 or bfloat16")
        memory.claim(gpu_memory_utilization)  # before the first JAX call starts the backend
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
            num_pages=num_pages,
            gpu_memory_utilization=gpu_memory_utilization,
            max_logprobs=max_logprobs,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            speculative=SpeculativeConfig.parse(speculative_config),
            async_scheduling=async_scheduling,
        )
        layout = CacheLayout.of(family, cfg, self.engine_config, self.dtype, sharding.dp_groups(self.mesh))

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
        )
        self.eos_token_ids = generation_eos_ids(self.path, self.config.eos_token_ids)
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

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_at_eos: bool = False,
        return_logits: bool = False,
    ):
        """New token ids per prompt, served concurrently through the engine.

        Greedy at temperature 0; sequences stop at EOS only with ``stop_at_eos``. With
        ``return_logits`` also returns, per prompt, the float32 logits [n_new, vocab] each new
        token was sampled from.
        """
        engine = self.engine
        ids = []
        for i, prompt in enumerate(prompts):
            request_id = f"llm-{next(self._ids)}"
            sampling = SamplingParams(
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=None if seed is None else seed + i,
                ignore_eos=not stop_at_eos,
            )
            engine.add_request(request_id, list(prompt), sampling, return_logits=return_logits)
            ids.append(request_id)
        tokens: dict[str, list[int]] = {r: [] for r in ids}
        logits: dict[str, list[np.ndarray]] = {r: [] for r in ids}
        while any(r in engine.requests for r in ids):
            for out in engine.step():
                if out.request_id in tokens and out.error is not None:
                    for r in ids:
                        engine.abort(r)
                    raise RuntimeError(f"prompt {ids.index(out.request_id)}: {out.error}")
                if out.request_id in tokens:
                    tokens[out.request_id] += out.new_token_ids
                    if out.logits is not None:
                        logits[out.request_id].append(out.logits)
        outputs = [tokens[r] for r in ids]
        if return_logits:
            return outputs, [np.stack(logits[r]) for r in ids]
        return outputs
