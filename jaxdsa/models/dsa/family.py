"""GLM-5.x / DeepSeek-V3.2 on the model-family seam (:class:`jaxdsa.models.family.ModelFamily`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxdsa.cache import Cache, CacheEntry, CacheSpec, StepMeta, kv_fp8
from jaxdsa.checkpoints.quant import QuantConfig
from jaxdsa.models.dsa import params
from jaxdsa.models.dsa.config import MODEL_TYPES, DsaConfig, parse_config
from jaxdsa.models.dsa.model import DsaModel
from jaxdsa.models.family import ModelFamily, collective_bytes
from jaxdsa.sharding import Parallelism


@dataclasses.dataclass(frozen=True)
class DsaMode:
    """``sparse``: indexer + top-k attention (some context is longer than index_topk);
    ``absorbed``: latent-space attention (False only for single-sequence prefill)."""

    sparse: bool
    absorbed: bool = True


class DsaFamily(ModelFamily):
    model_types = MODEL_TYPES

    def parse_config(self, raw: Mapping[str, Any], source: str) -> DsaConfig:
        return parse_config(raw, source)

    def quantization(self, cfg: DsaConfig) -> QuantConfig | None:
        return cfg.quantization

    def build(
        self,
        cfg: DsaConfig,
        *,
        dtype,
        rngs: nnx.Rngs,
        parallelism: Parallelism | None,
        mtp: int,
        scan_layers: bool = True,
    ) -> DsaModel:
        return DsaModel(
            cfg, dtype=dtype, rngs=rngs, parallelism=parallelism, mtp=mtp, scan_layers=scan_layers
        )

    def tensor_name(self, stored: str) -> str:
        return stored

    def mtp_layers(self, cfg: DsaConfig, has_tensor: Callable[[str], bool]) -> int:
        layers = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
        return sum(1 for layer in layers if has_tensor(params.mtp_marker(layer)))

    def param_spec(self, cfg: DsaConfig, model: DsaModel):
        return params.param_spec(cfg, model)

    def cache_spec(self, cfg: DsaConfig, kv_format: str = "model") -> CacheSpec:
        """Per layer a latent row (normed latent | roped key); index keys where an indexer runs.
        FP8: the ``fp8_ds_mla`` latent parts (e4m3 values, a float32 scale per 128, bf16 rope) and e4m3
        index keys with a float32 scale each (:mod:`pallas_kernels.quant.kv_fp8`): 656 + 132 bytes
        a token and layer at the released widths."""
        return _cache_spec(cfg, cfg.num_hidden_layers, len(cfg.indexer_layers), kv_format)

    def mtp_cache_spec(self, cfg: DsaConfig, kv_format: str = "model") -> CacheSpec:
        n = cfg.num_nextn_predict_layers
        return _cache_spec(cfg, n, n, kv_format)

    def hidden(self, model: DsaModel, tokens, positions, cache: Cache, meta: StepMeta, mode: DsaMode):
        h, cache = model(tokens, positions, cache, meta, sparse=mode.sparse, absorbed=mode.absorbed)
        return model.norm(h), cache

    def logits(self, model: DsaModel, hidden):
        return model.logits(hidden)

    def draft(self, model: DsaModel, hidden, tokens, positions, cache: Cache, meta: StepMeta, mode, layer):
        return model.draft(
            hidden, tokens, positions, cache, meta, sparse=mode.sparse, absorbed=mode.absorbed, layer=layer
        )

    def step_mode(self, cfg: DsaConfig, *, max_position: int, single_sequence: bool = False) -> DsaMode:
        return DsaMode(sparse=max_position + 1 > cfg.index_topk, absorbed=not single_sequence)

    def modes(self, cfg: DsaConfig, max_model_len: int) -> list[DsaMode]:
        return [DsaMode(sparse=False)] + ([DsaMode(sparse=True)] if max_model_len > cfg.index_topk else [])

    def decode_traffic(
        self, cfg: DsaConfig, par: Parallelism, batch: int, context: int, kv_format: str = "model"
    ) -> dict[str, float]:
        """Per device, one decode step of ``batch`` sequences per dp group at ``context`` tokens:
        cache bytes read (rows of the selected keys, index keys of the whole context once it
        outgrows index_topk; bf16 or fp8 per ``kv_format``), collective bytes, and the routing
        fan-out for the weight reads."""
        # bytes a token takes in one attention layer (latent) and in one indexer layer (key)
        row_bytes = lambda layers, index_layers: _cache_spec(  # noqa: E731
            cfg, layers, index_layers, kv_format
        ).bytes_per_token(jnp.bfloat16, 1)
        kv_rows = min(context, cfg.index_topk)
        read = batch * cfg.num_hidden_layers * kv_rows * row_bytes(1, 0)
        if context > cfg.index_topk:
            read += batch * len(cfg.indexer_layers) * context * row_bytes(0, 1)
        collective = collective_bytes(
            par,
            batch=batch,
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            moe_layers=cfg.num_hidden_layers - cfg.first_k_dense_replace,
            indexer_rows=len(cfg.indexer_layers) * context,
            experts_per_token=cfg.num_experts_per_tok,
        )
        return {
            "cache_bytes_read": float(read),
            "collective_bytes": collective,
            "experts_per_token": cfg.num_experts_per_tok,
            "num_experts": cfg.n_routed_experts,
        }

    def mode_context(self, cfg: DsaConfig, mode: DsaMode) -> int | None:
        """Dense steps hold only the first index_topk positions (every context fits in them)."""
        return None if mode.sparse else cfg.index_topk


def _cache_spec(cfg: DsaConfig, layers: int, index_layers: int, kv_format: str) -> CacheSpec:
    if kv_format == "model":
        return CacheSpec(
            {
                "latent": CacheEntry(layers, cfg.latent_dim),
                "index_keys": CacheEntry(index_layers, cfg.index_head_dim),
            }
        )
    if kv_format != "fp8":
        raise ValueError(f"unknown kv cache format {kv_format!r}")
    C, tiles = cfg.kv_lora_rank, cfg.kv_lora_rank // kv_fp8.TILE
    kv_fp8.latent_bytes(C, cfg.qk_rope_head_dim)  # raises for a latent width that is not whole tiles
    return CacheSpec(
        {
            "latent": CacheEntry(layers, C, jnp.float8_e4m3fn),
            "latent_scales": CacheEntry(layers, tiles, jnp.float32),
            "latent_rope": CacheEntry(layers, cfg.qk_rope_head_dim, jnp.bfloat16),
            "index_keys": CacheEntry(index_layers, cfg.index_head_dim, jnp.float8_e4m3fn),
            "index_scales": CacheEntry(index_layers, 1, jnp.float32),
        }
    )


FAMILY = DsaFamily()
