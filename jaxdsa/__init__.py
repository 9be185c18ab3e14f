"""jaxdsa: DeepSeek-Sparse-Attention MoE models (GLM-5.x, DeepSeek-V3.2) in JAX."""

from jaxdsa.config import ConfigError, ModelConfig, load_config
from jaxdsa.llm import LLM

__all__ = ["LLM", "ConfigError", "ModelConfig", "load_config"]
