"""jaxdsa: DeepSeek-Sparse-Attention MoE models (GLM-5.x, DeepSeek-V3.2) in JAX."""

from jaxdsa.config import ConfigError
from jaxdsa.llm import LLM
from jaxdsa.models.registry import load_config
from jaxdsa.text import SamplingParams

__all__ = ["LLM", "ConfigError", "SamplingParams", "load_config"]
