"""The notebook API: ``jaxdsa.LLM(path).score(ids)`` and ``.generate(prompts, ...)``.

``score`` is one full forward of a single sequence; ``generate`` prefills each prompt through the
paged cache (in chunks of ``prefill_chunk`` tokens) and then decodes all sequences together, one
token per step. Step shapes are padded to power-of-two buckets so each bucket compiles once.
"""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdsa.cache import KVCache, StepMeta, init_cache
from jaxdsa.config import ModelConfig
from jaxdsa.models.dsa import jitted_step

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two >= max(n, minimum): the padded size a shape compiles for."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


class LLM:
    """A GLM-5.x / DeepSeek-V3.2 checkpoint ready to score and generate."""

    def __init__(
        self,
        path: str | os.PathLike,
        dtype: str = "bfloat16",
        *,
        page_size: int = 64,
        prefill_chunk: int = 2048,
        progress: bool = True,
    ):
        from checkpoints.loader import load_params  # imported here: checkpoints imports jaxdsa.ops

        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: choose float32 or bfloat16")
        self.dtype = _DTYPES[dtype]
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.config, self.params = load_params(path, dtype=self.dtype, progress=progress)

    @property
    def _precision(self):
        # float32 means float32: no TF32 matmuls on GPUs.
        return jax.default_matmul_precision("highest") if self.dtype == jnp.float32 else contextlib.nullcontext()

    def _cache(self, num_pages: int) -> KVCache:
        return init_cache(self.config, num_pages, self.page_size, self.dtype)

    def _run(self, cache, tokens, positions, seq_ids, page_table, logits_at, *, sparse, absorbed):
        """One padded step; returns (logits [len(logits_at), V] numpy, cache)."""
        T, R = bucket(len(tokens)), bucket(len(logits_at))
        pad = lambda a, n, fill: np.concatenate([np.asarray(a, np.int32), np.full(n - len(a), fill, np.int32)])  # noqa: E731
        table = np.asarray(page_table, np.int32)
        table = np.pad(table, ((0, 0), (0, bucket(table.shape[1]) - table.shape[1])))
        meta = StepMeta(
            seq_ids=jnp.asarray(pad(seq_ids, T, -1)),
            page_table=jnp.asarray(table),
            logits_indices=jnp.asarray(pad(logits_at, R, 0)),
        )
        fn = jitted_step(self.config, sparse, absorbed)
        with self._precision:
            logits, cache = fn(self.params, jnp.asarray(pad(tokens, T, 0)), jnp.asarray(pad(positions, T, 0)), cache, meta)
        return np.asarray(logits)[: len(logits_at)], cache

    def _prefill(self, cache, ids: Sequence[int], start: int, table: np.ndarray):
        """Prefill ids at positions start.. of the sequence owning ``table``; logits of every token."""
        ids = list(ids)
        pos = list(range(start, start + len(ids)))
        sparse = start + len(ids) > self.config.index_topk
        return self._run(cache, ids, pos, [0] * len(ids), table[None], list(range(len(ids))), sparse=sparse, absorbed=False)

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits [len(token_ids), vocab] (float32) of one full forward over the sequence."""
        token_ids = list(token_ids)
        pages = -(-len(token_ids) // self.page_size)
        cache = self._cache(bucket(pages))
        logits, _ = self._prefill(cache, token_ids, 0, np.arange(pages))
        return logits

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        *,
        stop_at_eos: bool = False,
        seed: int = 0,
    ) -> list[list[int]]:
        """New token ids per prompt: chunked prefill, then batched decode through the KV cache.

        Greedy at temperature 0. With ``stop_at_eos`` a sequence ends at the config's EOS ids.
        """
        cfg = self.config
        prompts = [list(p) for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lengths = [len(p) + max_new_tokens for p in prompts]
        pages_per_seq = [-(-n // self.page_size) for n in lengths]
        starts = np.cumsum([0] + pages_per_seq)
        tables = np.zeros((len(prompts), max(pages_per_seq)), np.int32)
        for b, n in enumerate(pages_per_seq):
            tables[b, :n] = np.arange(starts[b], starts[b] + n)
        cache = self._cache(bucket(int(starts[-1])))
        rng = np.random.default_rng(seed)

        def sample(logits: np.ndarray) -> int:
            if temperature <= 0:
                return int(np.argmax(logits))
            z = logits / temperature
            p = np.exp(z - z.max())
            return int(rng.choice(len(p), p=p / p.sum()))

        last = []
        for b, prompt in enumerate(prompts):
            for c in range(0, len(prompt), self.prefill_chunk):
                logits, cache = self._prefill(cache, prompt[c : c + self.prefill_chunk], c, tables[b])
            last.append(logits[-1])
        outputs: list[list[int]] = [[sample(row)] for row in last]
        done = [stop_at_eos and o[-1] in cfg.eos_token_ids for o in outputs]
        while True:
            live = [b for b in range(len(prompts)) if not done[b] and len(outputs[b]) < max_new_tokens]
            if not live:
                break
            positions = [len(prompts[b]) + len(outputs[b]) - 1 for b in live]
            sparse = max(positions) + 1 > cfg.index_topk
            logits, cache = self._run(
                cache,
                [outputs[b][-1] for b in live],
                positions,
                list(range(len(live))),
                tables[live],
                list(range(len(live))),
                sparse=sparse,
                absorbed=True,
            )
            for row, b in zip(logits, live):
                outputs[b].append(sample(row))
                done[b] = stop_at_eos and outputs[b][-1] in cfg.eos_token_ids
        return outputs
