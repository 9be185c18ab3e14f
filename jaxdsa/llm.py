"""The notebook API: ``jaxdsa.LLM(path)``, its ``.model``, ``.score(ids)`` and ``.generate(prompts)``.

``model`` is the Flax NNX module tree: print it, index a layer (``model.layer(3)``), replace a
submodule, call it. ``score`` is one full forward of a single sequence over the current module
tree. ``generate`` runs on the serving engine: the prompts are served concurrently with
continuous batching, chunked prefill and the paged cache, exactly as the HTTP server serves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from jaxdsa.cache import StepMeta, init_cache
from jaxdsa.engine import Engine, EngineConfig, SamplingParams
from jaxdsa.engine.buckets import bucket
from jaxdsa.engine.runner import ModelState
from jaxdsa.engine.speculative import SpeculativeConfig
from jaxdsa.loading import load_model

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


@functools.cache
def _score_step(family, graphdef, treedef, axes: tuple, cache_axes: tuple, mode, mesh):
    """The jitted single-sequence forward of one model structure and mode (the cache is donated)."""

    def fn(leaves, tokens, positions, cache, meta):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        return family.step(model, tokens, positions, cache, meta, mode)

    cache_axes = dict(cache_axes)
    return sharding.jit_step(
        fn, mesh, donate_argnums=(3,), in_axes=(axes, None, None, cache_axes), out_axes=(None, cache_axes)
    )


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
    ):
        """``load_format="dummy"``: random weights of the checkpoint's config, made on the device
        (benchmarking real shapes without the files, like vLLM's ``--load-format dummy``).
        ``quantization``: ``"auto"`` keeps the checkpoint's FP8 / INT4 linears and experts in their
        format on the device, ``"dequantize"`` makes every weight dense in ``dtype``, ``"fp8"`` /
        ``"int4"`` assert the checkpoint's format or choose the dummy weights' (see
        :mod:`jaxdsa.quantization`). ``speculative_config``: vLLM's, e.g. ``{"method": "mtp",
        "num_speculative_tokens": 3}``: the engine drafts with the checkpoint's next-n layers and
        verifies the drafts in one step (greedy output unchanged, sampling distribution preserved)."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: choose float32 or bfloat16")
        self.path = os.fspath(path)
        self.dtype = _DTYPES[dtype]
        self.parallelism = sharding.Parallelism(tp=tp, ep=ep, dp=dp, dp_attention=dp_attention)
        self.mesh = sharding.make_mesh(self.parallelism) if self.parallelism.num_devices > 1 else None
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
        )
        self.eos_token_ids = generation_eos_ids(self.path, self.config.eos_token_ids)
        self.page_size = self.family.page_size(self.config, page_size)
        self.engine_config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            page_size=self.page_size,
            num_pages=num_pages,
            max_logprobs=max_logprobs,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            speculative=SpeculativeConfig.parse(speculative_config),
        )
        self._engine: Engine | None = None
        self._ids = itertools.count()

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
        ids = list(token_ids)
        if not ids:
            raise ValueError("token_ids is empty")
        dp = self.parallelism.dp
        T, pages = bucket(len(ids)), bucket(-(-len(ids) // self.page_size))
        group = lambda first, fill: np.asarray(
            list(first) + [fill] * (T - len(ids)) + [fill] * (T * (dp - 1)), np.int32
        )
        spec = self.family.cache_spec(self.config)
        cache_axes = spec.axes()
        placed = None
        if self.mesh is not None:
            placed = {
                k: jax.sharding.NamedSharding(self.mesh, sharding.spec(a)) for k, a in cache_axes.items()
            }
        cache = init_cache(spec, pages * dp, self.page_size, self.dtype, num_seqs=dp, sharding=placed)
        meta = StepMeta(
            seq_ids=group([0] * len(ids), -1),
            page_table=np.tile(np.arange(pages, dtype=np.int32), (dp, 1)),
            logits_indices=np.tile(np.arange(T, dtype=np.int32), dp),
        )
        args = (group(ids, 0), group(range(len(ids)), 0), meta)
        if self.mesh is not None:
            args = sharding.put(args, self.mesh, sharding.batch_spec())
        tokens, positions, meta = jax.tree.map(jnp.asarray, args)
        state = ModelState(self.model)
        mode = self.family.step_mode(self.config, max_position=len(ids) - 1, single_sequence=True)
        fn = _score_step(
            self.family, state.graphdef, state.treedef, state.axes, tuple(cache_axes.items()), mode, self.mesh
        )
        with self._precision():
            logits, _ = fn(state.leaves, tokens, positions, cache, meta)
        return sharding.fetch(logits)[: len(ids)]

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
