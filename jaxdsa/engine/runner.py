"""Runs scheduled segments on the device: padded buffers, one jitted step + sampling per bucket.

Shapes come from a small set of buckets so every step compiles once: the token count is padded
to a power of two (up to max_num_batched_tokens), the sampled rows to min(tokens, max_num_seqs);
the page table always has max_num_seqs rows. Steps whose contexts all fit in index_topk run the
dense path over a page table narrowed to index_topk tokens.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdsa.cache import KVCache, StepMeta
from jaxdsa.config import ModelConfig
from jaxdsa.engine.request import Request
from jaxdsa.engine.sampling import sample
from jaxdsa.engine.scheduler import Segment
from jaxdsa.models.dsa import step


def token_buckets(max_tokens: int) -> list[int]:
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_tokens]


def _fused_step(params, tokens, positions, cache, meta, temperature, top_p, top_k, seeds, counters, *, cfg, sparse, with_logits):
    logits, cache = step(params, tokens, positions, cache, meta, cfg=cfg, sparse=sparse, absorbed=True)
    ids = sample(logits, temperature, top_p, top_k, seeds, counters)
    return ids, (logits if with_logits else None), cache


@functools.cache
def _compiled(cfg: ModelConfig, sparse: bool, with_logits: bool):
    return jax.jit(functools.partial(_fused_step, cfg=cfg, sparse=sparse, with_logits=with_logits), donate_argnums=(3,))


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict, cache: KVCache, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, precision=None):
        self.cfg, self.params, self.cache = cfg, params, cache
        self.page_size = cache.page_size
        self.max_num_seqs = max_num_seqs
        self.buckets = token_buckets(max_num_batched_tokens)
        self.page_table = np.zeros((max_num_seqs, -(-max_model_len // self.page_size)), np.int32)
        self.dense_pages = min(self.page_table.shape[1], -(-cfg.index_topk // self.page_size))
        self.can_be_sparse = max_model_len > cfg.index_topk
        self.precision = precision

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _call(self, tokens, positions, seq_ids, logits_at, sampling_rows, *, sparse: bool, with_logits: bool):
        T = self._bucket(len(tokens))
        R = min(T, self.max_num_seqs)
        pad = lambda a, n, fill, dt=np.int32: np.concatenate([np.asarray(a, dt), np.full(n - len(a), fill, dt)])  # noqa: E731
        table = self.page_table if sparse else self.page_table[:, : self.dense_pages]
        meta = StepMeta(jnp.asarray(pad(seq_ids, T, -1)), jnp.asarray(table), jnp.asarray(pad(logits_at, R, 0)))
        temp, top_p, top_k, seeds, counters = (
            pad([r[i] for r in sampling_rows], R, fill, dt) for i, (fill, dt) in enumerate([(0, np.float32), (1, np.float32), (0, np.int32), (0, np.int32), (0, np.int32)])
        )
        fn = _compiled(self.cfg, sparse, with_logits)
        with self.precision() if self.precision else contextlib.nullcontext():
            ids, logits, self.cache = fn(self.params, jnp.asarray(pad(tokens, T, 0)), jnp.asarray(pad(positions, T, 0)), self.cache, meta, temp, top_p, top_k, seeds, counters)
        n = len(logits_at)
        return np.asarray(ids)[:n], (np.asarray(logits)[:n] if with_logits else None)

    def run(self, segments: list[Segment], seeds: dict[str, int], *, with_logits: bool = False):
        """-> (sampled token id per sampling segment, logits rows or None), in segment order."""
        tokens, positions, seq_ids, logits_at, rows = [], [], [], [], []
        for s in segments:
            r: Request = s.request
            self.page_table[r.slot, : len(r.pages)] = r.pages
            tokens += r.tokens[s.start : s.start + s.length]
            positions += range(s.start, s.start + s.length)
            seq_ids += [r.slot] * s.length
            if s.samples:
                logits_at.append(len(tokens) - 1)
                sp = r.sampling
                rows.append((sp.temperature, sp.top_p, sp.top_k, seeds[r.request_id], len(r.output)))
        sparse = max(positions) + 1 > self.cfg.index_topk
        return self._call(tokens, positions, seq_ids, logits_at, rows, sparse=sparse, with_logits=with_logits)

    def warmup(self, report=None) -> None:
        """Compile every bucket (and the sparse path when contexts can outgrow index_topk)."""
        variants = [(b, sparse) for sparse in ([False, True] if self.can_be_sparse else [False]) for b in self.buckets]
        for i, (b, sparse) in enumerate(variants):
            # All-padding inputs: nothing is written to the cache (slot -1 writes are dropped).
            self._call([0] * b, [0] * b, [-1] * b, [0], [(0.0, 1.0, 0, 0, 0)], sparse=sparse, with_logits=False)
            if report:
                report(i + 1, len(variants))
