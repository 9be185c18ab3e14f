"""GLM-5.3-Flash on the model-family seam (:class:`jaxdsa.models.family.ModelFamily`).

The cache, per layer kind (docs/models.md §9.9), in the model's dtype unless said:

=================  ============  ======================  ============================================
entry              layers        width                   rows
=================  ============  ======================  ============================================
``latent``         DSA           kv_lora_rank            paged, 1 per token: the normed latent (NoPE)
``index_keys``     full indexer  index_head_dim          paged, 1 per m tokens: a complete pool's key
``index_ring``     full indexer  2 index_head_dim, f32   ring of m: the open pool's ``[kI | z]`` rows
``kda_state``      KDA           H K V, f32              ring of 1: the recurrent state
``kda_conv``       KDA           H 3 K                   ring of W - 1: the last convolution inputs
=================  ============  ======================  ============================================

At the released widths that is 11 KB a token and 140 MiB a sequence (the KDA states; the KDA entries
are head-major and split over TP with the heads, ``linear_heads``, so each device holds a tp-th of
them). The states hold only what their sequence computed, so a cached prefix cannot be resumed from
its pages alone: prefix caching is off for this family (:meth:`Glm5NextFamily.prefix_caching`), as it
is for DeepSeek-V4; a snapshot of the states at page boundaries would lift that. HF defines no next-n
layer for this model, so there is no MTP; the FP8 cache formats are not defined for it yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxdsa.cache import Cache, CacheEntry, CacheSpec, StepMeta
from jaxdsa.checkpoints.quant import QuantConfig
from jaxdsa.models.dsa.family import DsaMode
from jaxdsa.models.family import ModelFamily, check_splits, collective_bytes
from jaxdsa.models.glm5_next import params
from jaxdsa.models.glm5_next.config import MODEL_TYPE, Glm5NextConfig, parse_config
from jaxdsa.models.glm5_next.model import Glm5NextModel
from jaxdsa.sharding import Parallelism

log = logging.getLogger(__name__)


class Glm5NextFamily(ModelFamily):
    model_types = (MODEL_TYPE,)

    def parse_config(self, raw: Mapping[str, Any], source: str) -> Glm5NextConfig:
        return parse_config(raw, source)

    def quantization(self, cfg: Glm5NextConfig) -> QuantConfig | None:
        return cfg.quantization

    def build(
        self,
        cfg: Glm5NextConfig,
        *,
        dtype,
        rngs: nnx.Rngs,
        parallelism: Parallelism | None,
        mtp: int,
        scan_layers: bool = True,
    ) -> Glm5NextModel:
        if mtp:
            raise ValueError(
                "GLM-5.3-Flash has no next-n (MTP) layer that jaxdsa can run (docs/models.md §9.11)"
            )
        if parallelism is not None:  # KDA heads are not padded (MLA and index heads are)
            heads = {"linear_num_heads": (cfg.linear_num_heads, "linear_heads")}
            check_splits("GLM-5.3-Flash", heads, parallelism)
        return Glm5NextModel(cfg, dtype=dtype, rngs=rngs, parallelism=parallelism, scan_layers=scan_layers)

    def tensor_name(self, stored: str) -> str:
        return stored

    def mtp_layers(self, cfg: Glm5NextConfig, has_tensor: Callable[[str], bool]) -> int:
        return 0

    def param_spec(self, cfg: Glm5NextConfig, model: Glm5NextModel):
        log.info("GLM-5.3-Flash: serving the text model; the vision tower (%s*) is not loaded", params.VISION)
        return params.param_spec(cfg, model)

    def cache_spec(self, cfg: Glm5NextConfig, kv_format: str = "model") -> CacheSpec:
        if kv_format != "model":
            raise ValueError(
                f"GLM-5.3-Flash: the {kv_format!r} cache format is not defined for this model yet"
            )
        H, K, m = cfg.linear_num_heads, cfg.linear_head_dim, cfg.index_kpool
        kda, dsa, full = len(cfg.kda_layers), len(cfg.dsa_layers), len(cfg.indexer_layers)
        f32 = jnp.float32
        return CacheSpec(
            {
                "latent": CacheEntry(dsa, cfg.kv_lora_rank),
                "index_keys": CacheEntry(full, cfg.index_head_dim, ratio=m),
                "index_ring": CacheEntry(full, 2 * cfg.index_head_dim, f32, ring=m),
                "kda_state": CacheEntry(kda, H * K * K, f32, ring=1, width_axis="linear_heads"),
                "kda_conv": CacheEntry(
                    kda, H * 3 * K, ring=cfg.linear_conv_kernel_dim - 1, width_axis="linear_heads"
                ),
            }
        )

    def mtp_cache_spec(self, cfg: Glm5NextConfig, kv_format: str = "model") -> CacheSpec:
        return CacheSpec({})

    def page_size(self, cfg: Glm5NextConfig, requested: int | None) -> int:
        """A page holds whole key pools."""
        size = super().page_size(cfg, requested)
        if size % cfg.index_kpool:
            raise ValueError(
                f"GLM-5.3-Flash: page size (--block-size) {size} is not a multiple of index_kpool "
                f"{cfg.index_kpool} (config.json)"
            )
        return size

    def prefix_caching(self, cfg: Glm5NextConfig) -> bool:
        return False

    def hidden(self, model: Glm5NextModel, tokens, positions, cache: Cache, meta: StepMeta, mode: DsaMode):
        return model(tokens, positions, cache, meta, sparse=mode.sparse, absorbed=mode.absorbed)

    def logits(self, model: Glm5NextModel, streams):
        return model.logits(streams)

    def draft(self, model, hidden, tokens, positions, cache, meta, mode, layer):
        raise NotImplementedError("GLM-5.3-Flash has no next-n (MTP) layer")

    def _dense_until(self, cfg: Glm5NextConfig) -> int:
        """Positions a query attends densely: below this, every complete pool is selected."""
        return (cfg.index_pools + 1) * cfg.index_kpool - 1

    def step_mode(self, cfg: Glm5NextConfig, *, max_position: int, single_sequence: bool = False) -> DsaMode:
        return DsaMode(sparse=max_position >= self._dense_until(cfg), absorbed=not single_sequence)

    def modes(self, cfg: Glm5NextConfig, max_model_len: int) -> list[DsaMode]:
        sparse = [DsaMode(sparse=True)] if max_model_len > self._dense_until(cfg) else []
        return [DsaMode(sparse=False)] + sparse

    def mode_context(self, cfg: Glm5NextConfig, mode: DsaMode) -> int | None:
        """Dense steps hold only the positions below the sparse threshold."""
        return None if mode.sparse else self._dense_until(cfg)

    def decode_traffic(
        self, cfg: Glm5NextConfig, par: Parallelism, batch: int, context: int, kv_format: str = "model"
    ) -> dict[str, float]:
        """Per device, one decode step of ``batch`` sequences per dp group at ``context`` tokens: the
        latent rows the DSA layers attend, the pool keys the indexers score, every KDA state read and
        written and its convolution rows (the device's heads); collectives as
        :func:`~jaxdsa.models.family.collective_bytes`."""
        spec = self.cache_spec(cfg, kv_format).entries
        row = lambda name: spec[name].itemsize(jnp.bfloat16) * spec[name].device_width(par.shards)  # noqa: E731
        attended = min(context, cfg.index_width)
        pools = context // cfg.index_kpool
        per_seq = len(cfg.dsa_layers) * attended * row("latent") + len(cfg.indexer_layers) * pools * row(
            "index_keys"
        )
        per_seq += len(cfg.kda_layers) * (
            2 * row("kda_state") + (cfg.linear_conv_kernel_dim - 1) * row("kda_conv")
        )
        return {
            "cache_bytes_read": float(batch * per_seq),
            "collective_bytes": collective_bytes(
                par,
                batch=batch,
                hidden=cfg.hidden_size,
                layers=cfg.num_hidden_layers,
                moe_layers=sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)),
                indexer_rows=len(cfg.indexer_layers) * pools,
                experts_per_token=cfg.num_experts_per_tok,
            ),
            "experts_per_token": cfg.num_experts_per_tok,
            "num_experts": cfg.n_routed_experts,
        }


FAMILY = Glm5NextFamily()
