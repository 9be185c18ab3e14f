"""DeepSeek-V4 on the model-family seam (:class:`jaxdsa.models.family.ModelFamily`).

The cache (docs/models.md §5.3-§5.6: the released engines' compact layout, in the model's dtype):
what only the last positions need is a per-sequence ring (W rows of the window, the compressor's
m or 2m source rows, each plus the speculative lookahead); what every later query may read is paged,
one row per m tokens:

=================  ===========  ===================  ===========================================
entry              layers       width                rows
=================  ===========  ===================  ===========================================
``window``         all          head_dim             ring of W: each token's K = V row
``csa_state``      CSA          4 head_dim, f32      ring of 2m: ``[C | Z + ape]`` of the compressor
``csa_entries``    CSA          head_dim             paged, 1 per m tokens: the compressed entries
``index_state``    CSA          4 index_head_dim     ring of 2m: the indexer compressor's rows, f32
``index_keys``     CSA          index_head_dim       paged, 1 per m tokens: the indexer's keys
``hca_state``      HCA          2 head_dim, f32      ring of m: ``[C | Z + ape]``
``hca_entries``    HCA          head_dim             paged, 1 per m tokens
=================  ===========  ===================  ===========================================

For V4-Flash that is 6.9 KB per token (bf16) and 17 MiB per sequence. ``--kv-cache-dtype fp8`` keeps
the window and entry rows as MODEL1's parts (``{name}``: e4m3 nope values, ``{name}_scales``: a
ue8m0 byte per 64, ``{name}_rope``: bf16; 583 bytes a row against 1,024) and the index keys in e4m3
with ``index_scales`` (132 bytes against 256). A ring holds only what its
sequence computed, so a cached prefix cannot be resumed from its pages alone: prefix caching is off
for V4 (:meth:`V4Family.prefix_caching`). The page size must be a multiple of every compression
ratio (a page holds whole windows), 128 for the released models, like vLLM's V4 block size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxdsa.cache import Cache, CacheEntry, CacheSpec, StepMeta, kv_fp8
from jaxdsa.checkpoints.quant import QuantConfig
from jaxdsa.models.deepseek_v4 import params
from jaxdsa.models.deepseek_v4.config import CSA, HCA, MODEL_TYPE, V4Config, v4_config_from_dict
from jaxdsa.models.deepseek_v4.model import V4Model
from jaxdsa.models.family import DEFAULT_PAGE_SIZE, ModelFamily, check_splits, collective_bytes
from jaxdsa.sharding import Parallelism

# V4 has one step variant: every step runs the window, the compressors and the indexer.
STEP = "window+compressed"


def _cache_spec(cfg: V4Config, layers: list[tuple[str, int]], kv_format: str) -> CacheSpec:
    """The cache of ``layers`` ((kind, ratio) each): a kind's layers are stacked, so share a ratio.
    FP8 (``kv_format`` "fp8"): the window and compressed-entry rows in MODEL1 parts (e4m3 nope values,
    a ue8m0 byte per 64, bf16 rope; :mod:`pallas_kernels.quant.kv_fp8`), index keys in e4m3 with a
    float32 scale each; the compressors' state stays float32."""
    if kv_format not in ("model", "fp8"):
        raise ValueError(f"unknown kv cache format {kv_format!r}")
    d, di, W = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    ratio = {kind: {m for k, m in layers if k == kind} for kind in (CSA, HCA)}
    for kind, ratios in ratio.items():
        if len(ratios) > 1:
            raise ValueError(
                f"DeepSeek-V4: the {kind} layers have several compression ratios {sorted(ratios)}"
            )
    csa, hca = [sum(k == kind for k, _ in layers) for kind in (CSA, HCA)]
    m_csa, m_hca = min(ratio[CSA] or {1}), min(ratio[HCA] or {1})
    f32 = jnp.float32
    rows = functools.partial(_rows, cfg, fp8=kv_format == "fp8")
    keys = {"index_keys": CacheEntry(csa, di, ratio=m_csa)}
    if kv_format == "fp8":
        keys = {
            "index_keys": CacheEntry(csa, di, jnp.float8_e4m3fn, ratio=m_csa),
            "index_scales": CacheEntry(csa, 1, f32, ratio=m_csa),
        }
    return CacheSpec(
        {
            **rows("window", len(layers), ring=W),
            "csa_state": CacheEntry(csa, 4 * d, f32, ring=2 * m_csa),
            **rows("csa_entries", csa, ratio=m_csa),
            "index_state": CacheEntry(csa, 4 * di, f32, ring=2 * m_csa),
            **keys,
            "hca_state": CacheEntry(hca, 2 * d, f32, ring=m_hca),
            **rows("hca_entries", hca, ratio=m_hca),
        }
    )


def _rows(cfg: V4Config, name: str, layers: int, *, fp8: bool, **where) -> dict[str, CacheEntry]:
    """The cache entries of K = V rows called ``name``: one ``head_dim`` row in the model's dtype, or
    MODEL1's three parts (:class:`~jaxdsa.layers.mla.LatentPages` reads them)."""
    d, r = cfg.head_dim, cfg.qk_rope_head_dim
    if not fp8:
        return {name: CacheEntry(layers, d, **where)}
    nope = d - r
    tiles = nope // kv_fp8.MODEL1.tile_width(nope)  # raises for a width that is not whole tiles
    return {
        name: CacheEntry(layers, nope, jnp.float8_e4m3fn, **where),
        f"{name}_scales": CacheEntry(layers, tiles, jnp.uint8, **where),
        f"{name}_rope": CacheEntry(layers, r, jnp.bfloat16, **where),
    }


def _ratios(cfg: V4Config) -> set[int]:
    return {m for m in (*cfg.compress_ratios, cfg.mtp_compress_ratio) if m}


def _check_splits(cfg: V4Config, par: Parallelism) -> None:
    """V4's split dims must divide evenly (its heads are not padded: released sizes never need it)."""
    splits = {
        "num_attention_heads": (cfg.num_attention_heads, "heads"),
        "index_n_heads": (cfg.index_n_heads, "index_heads"),
        "o_groups * o_lora_rank": (cfg.o_groups * cfg.o_lora_rank, "o_rank"),
        "moe_intermediate_size": (cfg.moe_intermediate_size, "mlp"),
        "n_routed_experts": (cfg.n_routed_experts, "experts"),
        "vocab_size": (cfg.vocab_size, "vocab"),
    }
    check_splits("DeepSeek-V4", splits, par)


class V4Family(ModelFamily):
    model_types = (MODEL_TYPE,)

    def parse_config(self, raw: Mapping[str, Any], source: str) -> V4Config:
        return v4_config_from_dict(raw, source)

    def quantization(self, cfg: V4Config) -> QuantConfig | None:
        return cfg.quantization

    def tensor_name(self, stored: str) -> str:
        return params.tensor_name(stored)

    def build(
        self,
        cfg: V4Config,
        *,
        dtype,
        rngs: nnx.Rngs,
        parallelism: Parallelism | None,
        mtp: int,
        scan_layers: bool = True,
    ) -> V4Model:
        if parallelism is not None:
            _check_splits(cfg, parallelism)
        return V4Model(cfg, dtype=dtype, rngs=rngs, mtp=mtp, scan_layers=scan_layers)

    def mtp_layers(self, cfg: V4Config, has_tensor: Callable[[str], bool]) -> int:
        return int(cfg.num_nextn_predict_layers > 0 and has_tensor(params.MTP_MARKER))

    def param_spec(self, cfg: V4Config, model: V4Model):
        return params.param_spec(cfg, model)

    def cache_spec(self, cfg: V4Config, kv_format: str = "model") -> CacheSpec:
        return _cache_spec(cfg, list(zip(cfg.layer_types, cfg.compress_ratios)), kv_format)

    def mtp_cache_spec(self, cfg: V4Config, kv_format: str = "model") -> CacheSpec:
        return _cache_spec(cfg, [(cfg.mtp_layer_type, cfg.mtp_compress_ratio)], kv_format)

    def page_size(self, cfg: V4Config, requested: int | None) -> int:
        """A page holds whole compression windows: a multiple of every ratio (default: the least one
        of at least the usual default)."""
        multiple = math.lcm(*_ratios(cfg))
        if requested is None:
            return multiple * -(-DEFAULT_PAGE_SIZE // multiple)
        if requested % multiple:
            raise ValueError(
                f"DeepSeek-V4: page size (--block-size) {requested} is not a multiple of the compression "
                f"ratios {sorted(_ratios(cfg))} (config.json); use a multiple of {multiple}"
            )
        return requested

    def prefix_caching(self, cfg: V4Config) -> bool:
        return False

    def hidden(self, model: V4Model, tokens, positions, cache: Cache, meta: StepMeta, mode):
        return model(tokens, positions, cache, meta)

    def logits(self, model: V4Model, streams):
        return model.logits(streams)

    def draft(self, model: V4Model, streams, tokens, positions, cache: Cache, meta: StepMeta, mode, layer):
        return model.draft(streams, tokens, positions, cache, meta, layer=layer)

    def step_mode(self, cfg: V4Config, *, max_position: int, single_sequence: bool = False) -> str:
        return STEP

    def modes(self, cfg: V4Config, max_model_len: int) -> list[str]:
        return [STEP]

    def decode_traffic(
        self, cfg: V4Config, par: Parallelism, batch: int, context: int, kv_format: str = "model"
    ) -> dict[str, float]:
        """Per device, one decode step of ``batch`` sequences per dp group at ``context`` tokens: the
        window rows, the compressed entries each layer attends (CSA: top-k, HCA: all), the index keys
        the indexer scores (one per m tokens) and the state rows every token gathers for pooling (a
        decode step pools for every row, since whether a row completes a window is data), the cache
        being whole on every TP device (one K = V head), bf16 or FP8 rows per ``kv_format``;
        collectives as :func:`~jaxdsa.models.family.collective_bytes`."""
        spec = self.cache_spec(cfg, kv_format).entries
        row_bytes = lambda name: sum(  # noqa: E731  one row of an entry with its FP8 parts, if any
            spec[n].itemsize(jnp.bfloat16) * spec[n].width
            for n in (name, f"{name}_scales", f"{name}_rope")
            if n in spec
        )
        row, key = row_bytes("window"), row_bytes("index_keys") + row_bytes("index_scales")
        d, di, rows = cfg.head_dim, cfg.index_head_dim, 0.0
        for kind, m in zip(cfg.layer_types, cfg.compress_ratios):
            rows += min(context, cfg.sliding_window) * row
            if kind == CSA:
                rows += min(cfg.index_topk, context // m) * row + context // m * key
                rows += 2 * m * 4 * (d + di) * 4  # the state rows are float32
            elif kind == HCA:
                rows += context // m * row + m * 2 * d * 4
        return {
            "cache_bytes_read": float(batch * rows),
            "collective_bytes": collective_bytes(
                par,
                batch=batch,
                hidden=cfg.hidden_size,
                layers=cfg.num_hidden_layers,
                moe_layers=cfg.num_hidden_layers,
                indexer_rows=sum(
                    context // m for kind, m in zip(cfg.layer_types, cfg.compress_ratios) if kind == CSA
                ),
                experts_per_token=cfg.num_experts_per_tok,
            ),
            "experts_per_token": cfg.num_experts_per_tok,
            "num_experts": cfg.n_routed_experts,
        }


FAMILY = V4Family()
