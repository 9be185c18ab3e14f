"""The serving engine: scheduler, page allocator, device runner and sampling."""

from jaxdsa.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from jaxdsa.engine.config import EngineConfig
from jaxdsa.engine.engine import Engine
from jaxdsa.engine.request import FinishReason, RequestOutput, SamplingParams, TokenLogprobs
from jaxdsa.engine.speculative import SpeculativeConfig

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "FinishReason",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "TokenLogprobs",
]
