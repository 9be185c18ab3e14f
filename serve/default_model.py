"""The model ``python -m serve`` serves when given none: a tiny random GLM-5-architecture checkpoint.

It is written once by ``checkpoints.tiny`` (deterministic: seed 0, float32, the tokenizer's
vocabulary) into ``$JAXDSA_CACHE_DIR/default-model`` (default ``~/.cache/jaxdsa/default-model``),
so the first run needs no download and later runs reuse it. Its outputs are random text: it exists
to try the server, the client code and the tooling, not to answer questions.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from checkpoints.tiny.make import make_tiny

NAME = "jaxdsa-tiny-glm5"
_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)


def cache_root() -> str:
    return os.environ.get("JAXDSA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxdsa")


def ensure_default_model() -> str:
    """The default model's directory, writing it first if it is missing or incomplete."""
    target = os.path.join(cache_root(), "default-model")
    if all(os.path.isfile(os.path.join(target, f)) for f in _FILES):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    # Write beside the target and rename, so an interrupted run never leaves a half model behind.
    staging = tempfile.mkdtemp(prefix="default-model.", dir=cache_root())
    try:
        make_tiny("glm_moe_dsa", staging, seed=0, dtype="float32")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
