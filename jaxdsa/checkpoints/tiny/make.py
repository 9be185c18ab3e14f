""":func:`make_tiny`: one random tiny checkpoint of any family, written by the family's maker
(:mod:`jaxdsa.checkpoints.tiny.dsa` for GLM-5.x and DeepSeek-V3.2, :mod:`jaxdsa.checkpoints.tiny.v4` for
DeepSeek-V4, :mod:`jaxdsa.checkpoints.tiny.glm5_next` for GLM-5.3-Flash)."""

from __future__ import annotations

import os
from typing import Any

from jaxdsa.checkpoints.tiny import dsa, glm5_next, v4
from jaxdsa.checkpoints.tiny.presets import DEFAULT_PRESET
from jaxdsa.checkpoints.tiny.writers import DTYPES

# The version of what make_tiny writes: bump it when the same arguments start to give other files
# (the weights' draw, tensor names, the tokenizer's corpus), so that copies written before, the
# bundled default model among them (``jaxdsa.serve.default_model``), are seen as stale and rewritten.
# (The default model's stamp also holds its config and a hash of its tokenizer config, chat
# template included, so changes to those are seen without a bump.)
MAKER_VERSION = 1


def make_tiny(
    family: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    preset: str | None = None,
    dtype: str = "float32",
    shards: int = 1,
    overrides: dict[str, Any] | None = None,
    quant: str | None = None,
) -> str:
    """Write the tiny checkpoint directory and return its path. ``overrides``: config.json fields
    replacing the preset's (wider layers for a load that must outweigh the interpreter's own
    allocations, say; GLM-5.3-Flash: its ``text_config`` fields). ``quant="nvfp4"``: the linears
    stored as ModelOpt NVFP4 (GLM-5.x and DeepSeek-V3.2 only)."""
    if family not in DEFAULT_PRESET:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(DEFAULT_PRESET)}")
    preset = preset or DEFAULT_PRESET[family]
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out_dir = os.fspath(out_dir)
    if quant is not None and family not in ("glm_moe_dsa", "deepseek_v32"):
        raise ValueError(f"quant={quant!r} is written for glm_moe_dsa and deepseek_v32, not {family}")
    if family == "deepseek_v4":
        return v4.write(out_dir, seed=seed, preset=preset, dtype=dtype, shards=shards, overrides=overrides)
    if family == "glm5_next":
        return glm5_next.write(
            out_dir, seed=seed, preset=preset, dtype=dtype, shards=shards, overrides=overrides
        )
    return dsa.write(
        family,
        out_dir,
        seed=seed,
        preset=preset,
        dtype=dtype,
        shards=shards,
        overrides=overrides,
        quant=quant,
    )
