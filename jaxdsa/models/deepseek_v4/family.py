"""DeepSeek-V4 on the model-family seam (:class:`jaxdsa.models.family.ModelFamily`).

The cache (models.md §5.3-§5.5 describe what serving engines keep; this is a simpler layout, chosen
to be exact under chunked prefill, prefix caching and preemption with nothing outside the pages).
Every row lives at the slot of the token it belongs to, so a page holds only what its own tokens
determine and there is no per-sequence state:

=================  ===================  ===================  ===========================================
entry              layers               width                written at the slot of
=================  ===================  ===================  ===========================================
``window``         all                  head_dim             every token: its K = V row (read: the last W)
``csa_state``      CSA                  4 head_dim, f32      every token: ``[C | Z + ape]`` of its compressor
``csa_entries``    CSA                  head_dim             the token completing a window: the entry
``index_state``    CSA                  4 index_head_dim     every token: the indexer compressor's row, f32
``index_keys``     CSA                  index_head_dim       the token completing a window: the index key
``hca_state``      HCA                  2 head_dim, f32      every token: ``[C | Z + ape]``
``hca_entries``    HCA                  head_dim             the token completing a window: the entry
=================  ===================  ===================  ===========================================

The compressor's carried state of the reference (the last ``T mod m`` rows and CSA's previous window)
is thereby per token: the completing token reads its window's state rows back from the pages. Pages
are sized like every family's: ``page_size`` tokens of every entry, ``bytes_per_token`` summed over
the entries (float32 state included). That is far more than the released engines' layout (a ring of
W window rows, entries 1/m as dense, state for 2m rows per sequence); it is the correct baseline
those optimizations will be tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from checkpoints.quant import QuantConfig
from jaxdsa.cache import Cache, CacheEntry, CacheSpec, StepMeta
from jaxdsa.models.deepseek_v4 import params
from jaxdsa.models.deepseek_v4.config import CSA, HCA, MODEL_TYPE, V4Config, v4_config_from_dict
from jaxdsa.models.deepseek_v4.model import V4Model
from jaxdsa.models.family import ModelFamily, collective_bytes
from jaxdsa.sharding import Parallelism

# V4 has one step variant: every step runs the window, the compressors and the indexer.
STEP = "window+compressed"


def _cache_spec(cfg: V4Config, kinds: list[str]) -> CacheSpec:
    d, di = cfg.head_dim, cfg.index_head_dim
    csa, hca = kinds.count(CSA), kinds.count(HCA)
    return CacheSpec(
        {
            "window": CacheEntry(len(kinds), d),
            "csa_state": CacheEntry(csa, 4 * d, jnp.float32),
            "csa_entries": CacheEntry(csa, d),
            "index_state": CacheEntry(csa, 4 * di, jnp.float32),
            "index_keys": CacheEntry(csa, di),
            "hca_state": CacheEntry(hca, 2 * d, jnp.float32),
            "hca_entries": CacheEntry(hca, d),
        }
    )


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
    for field, (size, axis) in splits.items():
        if size % par.shards(axis):
            raise ValueError(
                f"DeepSeek-V4: {field} = {size} does not split evenly into {par.shards(axis)} shards "
                f"(tp={par.tp}, ep={par.ep}, dp={par.dp}{', dp attention' if par.dp_attention else ''})"
            )


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

    def cache_spec(self, cfg: V4Config) -> CacheSpec:
        return _cache_spec(cfg, list(cfg.layer_types))

    def mtp_cache_spec(self, cfg: V4Config) -> CacheSpec:
        return _cache_spec(cfg, [cfg.mtp_layer_type])

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

    def page_columns(self, cfg: V4Config, mode, page_size: int, columns: int) -> int:
        return columns

    def decode_traffic(self, cfg: V4Config, par: Parallelism, batch: int, context: int) -> dict[str, float]:
        """Per device, one decode step of ``batch`` sequences per dp group at ``context`` tokens: the
        window rows, the compressed entries each layer attends (CSA: top-k, HCA: all), the index keys
        the indexer scores and the state rows of the windows being pooled (the cache is whole on every
        TP device: one K = V head); collectives as :func:`~jaxdsa.models.family.collective_bytes`."""
        item = 2  # bf16 rows; the state is float32
        d, di, rows = cfg.head_dim, cfg.index_head_dim, 0.0
        for kind, m in zip(cfg.layer_types, cfg.compress_ratios):
            rows += min(context, cfg.sliding_window) * d * item
            if kind == CSA:
                rows += min(cfg.index_topk, context // m) * d * item + context * di * item
                rows += 2 * m * 4 * (d + di) * 4
            elif kind == HCA:
                rows += context // m * d * item + m * 2 * d * 4
        return {
            "cache_bytes_read": float(batch * rows),
            "collective_bytes": collective_bytes(
                par,
                batch=batch,
                hidden=cfg.hidden_size,
                layers=cfg.num_hidden_layers,
                moe_layers=cfg.num_hidden_layers,
                indexer_rows=cfg.layer_types.count(CSA) * context,
                experts_per_token=cfg.num_experts_per_tok,
            ),
            "experts_per_token": cfg.num_experts_per_tok,
            "num_experts": cfg.n_routed_experts,
        }


FAMILY = V4Family()
