"""Model families by Hugging Face ``model_type``; reading a checkpoint's config through them."""

from __future__ import annotations

import os
from typing import Any

from jaxdsa.checkpoints.tiny.presets import TINY_PRESETS
from jaxdsa.config import ConfigError, read_config_json
from jaxdsa.models.deepseek_v4.family import FAMILY as DEEPSEEK_V4
from jaxdsa.models.deepseek_v4.presets import RELEASED as V4_RELEASED
from jaxdsa.models.dsa.family import FAMILY as DSA
from jaxdsa.models.dsa.presets import RELEASED as DSA_RELEASED
from jaxdsa.models.family import ModelFamily
from jaxdsa.models.glm5_next.family import FAMILY as GLM5_NEXT
from jaxdsa.models.glm5_next.presets import RELEASED as GLM5_NEXT_RELEASED

FAMILIES: dict[str, ModelFamily] = {
    model_type: family for family in (DSA, DEEPSEEK_V4, GLM5_NEXT) for model_type in family.model_types
}


def family_for(model_type: str, source: str = "<config>") -> ModelFamily:
    if model_type not in FAMILIES:
        raise ConfigError(
            source, "model_type", f"unsupported {model_type!r}; jaxdsa runs {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Any:
    """A config.json dict parsed by its family (``family_for(cfg.model_type)`` finds the family)."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(source, "model_type", "missing (required)")
    return family_for(model_type, source).parse_config(raw, source)


def load_config(path: str | os.PathLike) -> Any:
    """The config of a checkpoint directory's config.json (or the file itself)."""
    raw, file = read_config_json(path)
    return config_from_dict(raw, file)


# The released models' config.json files, by the names the planner takes (``--preset``).
RELEASED: dict[str, dict[str, Any]] = {**DSA_RELEASED, **V4_RELEASED, **GLM5_NEXT_RELEASED}


def released_config(name: str) -> Any:
    """A released model's config ('glm5', 'glm52', 'dsv32', 'v4-flash', 'v4-pro', 'glm53-flash') parsed
    by its family."""
    if name not in RELEASED:
        raise ConfigError(f"<preset:{name}>", "preset", f"unknown; choose one of {', '.join(RELEASED)}")
    return config_from_dict(RELEASED[name], f"<preset:{name}>")


def tiny_config(name: str, **overrides: Any):
    """A named tiny preset ('glm5', 'glm52', 'dsv32', ...) parsed by its family, with overrides."""
    if name not in TINY_PRESETS:
        raise KeyError(f"unknown tiny preset {name!r}; choose from {sorted(TINY_PRESETS)}")
    return config_from_dict({**TINY_PRESETS[name], **overrides}, f"<tiny:{name}>")
