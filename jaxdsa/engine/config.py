"""The engine's settings (vLLM's engine arguments under the same names where they exist)."""

from __future__ import annotations

import dataclasses

from jaxdsa.engine.memory import DEFAULT_UTILIZATION
from jaxdsa.engine.speculative import SpeculativeConfig


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_model_len: int | None = None  # default: min(max_position_embeddings, 8192)
    max_num_batched_tokens: int = 512
    page_size: int | None = None  # default: the family's (64 for GLM-5.x / V3.2)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) or fp8 (jaxdsa.cache.kv_cache_format)
    num_pages: int | None = None  # default: what fits in gpu_memory_utilization, at most full concurrency
    gpu_memory_utilization: float = DEFAULT_UTILIZATION  # share of each device for weights, cache, steps
    seed: int = 0
    max_logprobs: int = 20  # most top logprobs a request may ask for (vLLM's default)
    enable_prefix_caching: bool = True  # reuse cached pages of shared token prefixes (vLLM's default)
    speculative: SpeculativeConfig | None = None  # draft with the model's next-n (MTP) layers
    # launch each step before the last one's tokens reach the host (vLLM's --async-scheduling)
    async_scheduling: bool = True
