"""Hugging Face checkpoint I/O: lazy safetensors reading, name maps, quantized formats, tiny models."""

from jaxdsa.checkpoints.errors import CheckpointError

__all__ = ["CheckpointError"]
