"""jaxdsa: DeepSeek-Sparse-Attention MoE models (GLM-5.x ``glm_moe_dsa``, DeepSeek-V3.2 ``deepseek_v32``,
DeepSeek-V4 ``deepseek_v4``) in JAX, served with Pallas-Triton kernels on NVIDIA GPUs."""

from jaxdsa.config import ConfigError
from jaxdsa.llm import LLM
from jaxdsa.models.registry import load_config
from jaxdsa.text import SamplingParams

__all__ = ["LLM", "ConfigError", "SamplingParams", "load_config"]
