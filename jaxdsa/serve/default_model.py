"""The model ``python -m serve`` serves when given none: a tiny random GLM-5-architecture checkpoint.

It is written by ``jaxdsa.checkpoints.tiny`` (deterministic: seed 0, float32, the tokenizer's vocabulary,
a context of :data:`CONTEXT` tokens, enough for a chat with several tools) into
``$JAXDSA_CACHE_DIR/default-model`` (default ``~/.cache/jaxdsa/default-model``), so the first run
needs no download. Beside the files goes a stamp (:data:`STAMP`) naming what they were made from:
the maker's version, the recipe, the config and the tokenizer config it gives. Later runs reuse the
directory while its stamp is the one this code would write, and rewrite it otherwise (a model from
an older jaxdsa, a foreign or half-written directory). Its outputs are random text: it exists to try
the server, the client code and the tooling, not to answer questions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from jaxdsa.checkpoints.tiny.make import MAKER_VERSION, make_tiny
from jaxdsa.checkpoints.tiny.presets import TINY_PRESETS
from jaxdsa.checkpoints.tokenizer_assets import tokenizer_config

NAME = "jaxdsa-tiny-glm5"
FAMILY, PRESET, SEED, DTYPE = "glm_moe_dsa", "glm5", 0, "float32"
# The bundled model's context: a GLM-5 chat with one small tool is ~340 tokens, so 4,096 leaves
# room for several tools and turns. The preset's RoPE is the plain one (theta 1e4, no YaRN), which
# any length takes; the server's default --max-model-len is this, and its cache is sized from it.
CONTEXT = 4096
OVERRIDES = {"max_position_embeddings": CONTEXT}
STAMP = "jaxdsa-default-model.json"
_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)


def cache_root() -> str:
    return os.environ.get("JAXDSA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxdsa")


def stamp() -> dict[str, Any]:
    """What the default model is made from; a directory whose stamp differs is rewritten."""
    config = {**TINY_PRESETS[PRESET], **OVERRIDES}
    tokenizer = json.dumps(tokenizer_config(FAMILY, CONTEXT), sort_keys=True, ensure_ascii=False)
    return {
        "maker_version": MAKER_VERSION,
        "recipe": {"family": FAMILY, "preset": PRESET, "seed": SEED, "dtype": DTYPE, "overrides": OVERRIDES},
        "config": config,  # before make_tiny sets vocab_size and dtype
        "tokenizer_config_sha256": hashlib.sha256(tokenizer.encode()).hexdigest(),
    }


def _up_to_date(target: str, expected: dict[str, Any]) -> bool:
    if not all(os.path.isfile(os.path.join(target, f)) for f in _FILES):
        return False
    try:
        with open(os.path.join(target, STAMP), encoding="utf-8") as fh:
            return json.load(fh) == expected
    except (OSError, ValueError):
        return False


def ensure_default_model() -> str:
    """The default model's directory, (re)writing it first unless it is there and up to date."""
    target = os.path.join(cache_root(), "default-model")
    expected = stamp()
    if _up_to_date(target, expected):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    # Write beside the target and rename, so an interrupted run never leaves a half model behind.
    staging = tempfile.mkdtemp(prefix="default-model.", dir=cache_root())
    try:
        make_tiny(FAMILY, staging, seed=SEED, preset=PRESET, dtype=DTYPE, overrides=OVERRIDES)
        with open(os.path.join(staging, STAMP), "w", encoding="utf-8") as fh:
            json.dump(expected, fh, indent=2, ensure_ascii=False)
            fh.write("\n")
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:  # another server wrote it between the rmtree and here: take theirs if current
            if not _up_to_date(target, expected):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
