"""Write a random tiny model in the real Hugging Face layout: the stand-in for a Hub checkpoint.

    python -m jaxdsa.checkpoints.make_tiny --family glm_moe_dsa|deepseek_v32|deepseek_v4|glm5_next --out DIR
        [--seed N] [--preset NAME] [--dtype float32|bfloat16] [--shards K] [--max-model-len N]
        [--quant nvfp4]

(``jaxdsa/checkpoints/make_tiny.py`` is the entry; the makers are :mod:`jaxdsa.checkpoints.tiny.dsa`,
:mod:`jaxdsa.checkpoints.tiny.v4` and :mod:`jaxdsa.checkpoints.tiny.glm5_next`.)
"""

from __future__ import annotations

import argparse

from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.checkpoints.tiny.presets import (
    DEFAULT_PRESET,
    GLM5_NEXT_TINY_PRESETS,
    TINY_PRESETS,
    V4_TINY_PRESETS,
)
from jaxdsa.checkpoints.tiny.writers import DTYPES


def main(argv: list[str] | None = None) -> None:
    def names(family: str) -> str:
        if family == "deepseek_v4":
            return ", ".join(sorted(V4_TINY_PRESETS))
        if family == "glm5_next":
            return ", ".join(sorted(GLM5_NEXT_TINY_PRESETS))
        return ", ".join(sorted(n for n, c in TINY_PRESETS.items() if c["model_type"] == family))

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(DEFAULT_PRESET))
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preset",
        default=None,
        help="the family's tiny preset ("
        + "; ".join(f"{f}: {names(f)}, default {DEFAULT_PRESET[f]}" for f in sorted(DEFAULT_PRESET))
        + ")",
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="the model's context (max_position_embeddings; default: the preset's)",
    )
    parser.add_argument(
        "--quant",
        choices=["nvfp4"],
        help="store the linears quantized: nvfp4 = NVIDIA ModelOpt NVFP4 (glm_moe_dsa, deepseek_v32)",
    )
    args = parser.parse_args(argv)
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error("--max-model-len must be >= 1")
    overrides = {} if args.max_model_len is None else {"max_position_embeddings": args.max_model_len}
    try:
        out = make_tiny(
            args.family,
            args.out,
            seed=args.seed,
            preset=args.preset,
            dtype=args.dtype,
            shards=args.shards,
            overrides=overrides,
            quant=args.quant,
        )
    except ValueError as e:
        parser.error(str(e))
    print(out)
