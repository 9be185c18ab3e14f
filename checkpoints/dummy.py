"""Random weights generated on the device, in exactly the layout a real checkpoint loads into.

Like vLLM's ``--load-format dummy``: for benchmarking real model shapes without tens of GB of
files. It walks the same name map as the loader (so transposes, head splits, kv_b splitting,
expert packing and sharding are the real ones) and draws each HF-orientation [out, in] matrix
from N(0, 1/in) with a key derived from the tensor's name, so every parallel layout of the same
seed holds the same model.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints import names
from jaxdsa import ops, sharding
from jaxdsa.config import ModelConfig


def _key(seed: int, name: str) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)


class _Random:
    def __init__(self, cfg: ModelConfig, dtype, mesh, seed: int):
        self.cfg, self.dtype, self.mesh, self.seed = cfg, dtype, mesh, seed

    def _place(self, make, path: tuple, ndim: int):
        if self.mesh is None:
            return jax.jit(make)()
        target = jax.sharding.NamedSharding(self.mesh, sharding.spec(sharding.leaf_axes(path, ndim)))
        return jax.jit(make, out_shardings=target)()

    def linear(self, spec: names.Linear, path: tuple):
        dtype = jnp.float32 if spec.keep_fp32 else self.dtype

        def make():
            w = (
                jax.random.normal(_key(self.seed, spec.name), (spec.out, spec.inp), jnp.float32)
                * spec.inp**-0.5
            )
            return spec.post(w).astype(dtype)

        return self._place(make, path, len(jax.eval_shape(make).shape))

    def tensor(self, spec: names.Tensor, path: tuple):
        dtype = jnp.float32 if spec.keep_fp32 else self.dtype
        # Norm weights near 1, biases (router correction, LayerNorm) small, embeddings N(0, 1).
        base, scale = (
            (1.0, 0.1) if spec.name.endswith("norm.weight") or "layernorm" in spec.name else (0.0, 1.0)
        )
        if spec.name.endswith("bias"):
            scale = 0.1
        make = lambda: (
            base + scale * jax.random.normal(_key(self.seed, spec.name), spec.shape, jnp.float32)
        ).astype(dtype)  # noqa: E731
        return self._place(make, path, len(spec.shape))

    def experts(self, spec: names.Experts, path: tuple):
        E, N, D = spec.num, spec.inter, spec.hidden
        tpi = 1 if self.mesh is None else self.mesh.shape["tpi"]

        def draw(which, shape, fan_in):
            return (
                jax.random.normal(_key(self.seed, f"{spec.prefix}.{which}"), shape, jnp.float32)
                * fan_in**-0.5
            ).astype(self.dtype)

        def make():
            gate, up, down = (
                draw("gate_proj", (E, N, D), D),
                draw("up_proj", (E, N, D), D),
                draw("down_proj", (E, D, N), N),
            )
            return ops.pack_experts(*sharding.expert_tp_order(gate, up, tpi), down)

        if self.mesh is None:
            return jax.jit(make)()
        shapes = jax.eval_shape(make)
        out = {
            k: jax.sharding.NamedSharding(
                self.mesh, sharding.spec(sharding.leaf_axes(path + (k,), len(v.shape)))
            )
            for k, v in shapes.items()
        }
        return jax.jit(make, out_shardings=out)()

    def load(self, tree: Any, path: tuple = ()) -> Any:
        if isinstance(tree, dict):
            return {k: self.load(v, path + (k,)) for k, v in tree.items()}
        if isinstance(tree, names.Linear):
            return self.linear(tree, path)
        if isinstance(tree, names.Tensor):
            return self.tensor(tree, path)
        return self.experts(tree, path)


def random_params(
    cfg: ModelConfig, *, dtype=jnp.bfloat16, mesh=None, seed: int = 0, mtp: bool = False
) -> dict:
    """A params pytree of ``cfg``'s shapes with random weights, placed (and sharded) on device."""
    if mesh is not None:
        for what, size, n in (
            ("attention heads", cfg.num_attention_heads, "heads"),
            ("indexer heads", cfg.index_n_heads, "index_heads"),
        ):
            shards = math.prod(mesh.shape[a] for a in sharding.RULES[n])
            if size % shards:
                raise ValueError(f"random weights: {what} ({size}) must split evenly over {shards} devices")
    gen = _Random(cfg, dtype, mesh, seed)
    params = gen.load(names.model_map(cfg))
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"].T
    params["layers"] = [
        gen.load(names.layer_map(cfg, i), ("layers", i)) for i in range(cfg.num_hidden_layers)
    ]
    if mtp:
        params["mtp"] = [
            gen.load(names.mtp_map(cfg, cfg.num_hidden_layers + i), ("mtp", i))
            for i in range(cfg.num_nextn_predict_layers)
        ]
    return params
