"""Load a DeepSeek-V4 checkpoint directory (HF-saved or release names; plain, FP8 or FP8 + FP4)
into the params pytree of :mod:`jaxdsa.models.deepseek_v4.params`.

Walks the family's declarative spec; each tensor is memory-mapped, decoded to float32 if it is
quantized (:mod:`checkpoints.v4_formats`), checked against the spec's shape and put in the math's
layout. Tensors the spec does not consume are an error (a misnamed tensor would otherwise be
silently replaced by nothing), except quantization scales and the MTP block when not loaded.
Every failure names the file and the tensor.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from checkpoints.errors import CheckpointError
from checkpoints.safetensors_io import CheckpointReader
from checkpoints.v4_formats import dequantize_fp4, dequantize_fp8
from jaxdsa import ops
from jaxdsa.models.deepseek_v4.config import V4Config, load_v4_config
from jaxdsa.models.deepseek_v4.params import ExpertsLeaf, Leaf, model_spec, release_name

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))
_INTS = (np.dtype(np.int64), np.dtype(np.int32))
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_PACKED = (np.dtype(np.int8), np.dtype(np.uint8))


class _Loader:
    def __init__(self, reader: CheckpointReader, cfg: V4Config, dtype):
        self.reader, self.cfg, self.dtype = reader, cfg, dtype
        self.stored: dict[str, str] = {}
        for name in reader.keys():
            release = release_name(name)
            if release in self.stored:
                raise self._fail(name, f"is the same tensor as '{self.stored[release]}' ({release})")
            self.stored[release] = name
        self.used: set[str] = set()

    def _fail(self, stored: str, message: str) -> CheckpointError:
        return CheckpointError(self.reader.file_of(stored), stored, message)

    def _name(self, release: str) -> str:
        if release not in self.stored:
            raise CheckpointError(self.reader.directory, release, "missing from the checkpoint")
        self.used.add(release)
        return self.stored[release]

    def _scale(self, release: str) -> np.ndarray:
        """The ``.scale`` (e8m0) next to a quantized ``.weight``; HF's ``weight_scale_inv`` also works."""
        base = release[: -len("weight")]
        for candidate in (base + "scale", release + "_scale_inv"):
            if candidate in self.stored:
                return self.reader.get(self._name(candidate))
        raise CheckpointError(
            self.reader.directory, base + "scale", f"missing: needed to dequantize {release}"
        )

    def matrix(self, release: str, shape: tuple[int, ...], *, quantizable: bool, fp4: bool) -> np.ndarray:
        """A float32 tensor in its stored [out, in] orientation, decoded from FP8 / FP4 if needed."""
        name = self._name(release)
        raw, stored_dtype = self.reader.get(name), self.reader.dtype(name)
        quant = self.cfg.quantization
        try:
            if stored_dtype == _E4M3:
                if not quantizable or quant is None:
                    raise self._fail(
                        name, "float8 weight, but it is not quantized in V4 / config.json has no fp8"
                    )
                value = dequantize_fp8(raw, self._scale(release), quant.weight_block_size)
            elif stored_dtype in _PACKED:
                if not fp4:
                    raise self._fail(
                        name, "packed int8 weight, but config.json does not say expert_dtype fp4"
                    )
                value = dequantize_fp4(raw, self._scale(release))
            elif stored_dtype in _FLOATS:
                value = np.asarray(raw, np.float32)
            else:
                raise self._fail(name, f"dtype {stored_dtype} is not a float or quantized weight type")
        except ValueError as e:
            if isinstance(e, CheckpointError):
                raise
            raise self._fail(name, str(e)) from None
        if value.shape != tuple(shape):
            raise self._fail(name, f"shape {list(value.shape)} != expected {list(shape)}")
        return value

    def leaf(self, spec: Leaf):
        if spec.index:
            name = self._name(spec.name)
            if self.reader.dtype(name) not in _INTS or self.reader.shape(name) != spec.shape:
                raise self._fail(name, f"expected integers of shape {list(spec.shape)}")
            table = np.asarray(self.reader.get(name))
            if table.min() < 0 or table.max() >= self.cfg.n_routed_experts:
                raise self._fail(name, f"expert ids outside [0, {self.cfg.n_routed_experts})")
            return jnp.asarray(table, jnp.int32)
        value = spec.post(self.matrix(spec.name, spec.shape, quantizable=spec.quantizable, fp4=False))
        return jnp.asarray(value, jnp.float32 if spec.keep_fp32 else self.dtype)

    def experts(self, spec: ExpertsLeaf):
        fp4 = self.cfg.expert_dtype == "fp4"
        stacks = {part: [] for part in ("w1", "w3", "w2")}
        for e in range(spec.num):
            for part, shape in (("w1", (spec.inter, spec.hidden)), ("w3", (spec.inter, spec.hidden))):
                stacks[part].append(
                    self.matrix(f"{spec.prefix}.{e}.{part}.weight", shape, quantizable=True, fp4=fp4)
                )
            w2 = self.matrix(
                f"{spec.prefix}.{e}.w2.weight", (spec.hidden, spec.inter), quantizable=True, fp4=fp4
            )
            stacks["w2"].append(w2)
        gate, up, down = (jnp.asarray(np.stack(stacks[p]), self.dtype) for p in ("w1", "w3", "w2"))
        return ops.pack_experts(gate, up, down)

    def walk(self, tree: Any) -> Any:
        if isinstance(tree, Leaf):
            return self.leaf(tree)
        if isinstance(tree, ExpertsLeaf):
            return self.experts(tree)
        if isinstance(tree, dict):
            return {k: self.walk(v) for k, v in tree.items()}
        return [self.walk(v) for v in tree]

    def check_all_used(self, *, mtp: bool) -> None:
        extra = [
            stored
            for release, stored in self.stored.items()
            if release not in self.used and not (not mtp and release.startswith("mtp."))
        ]
        if extra:
            raise self._fail(extra[0], f"not a DeepSeek-V4 tensor jaxdsa knows ({len(extra)} such tensors)")


def load_v4(
    directory: str | os.PathLike, *, dtype=jnp.float32, mtp: bool | None = None
) -> tuple[V4Config, dict]:
    """(config, params) of a V4 checkpoint directory. ``mtp=None`` loads the MTP block when present."""
    directory = os.fspath(directory)
    cfg = load_v4_config(directory)
    loader = _Loader(CheckpointReader(directory), cfg, jnp.dtype(dtype))
    if mtp is None:
        mtp = any(name.startswith("mtp.") for name in loader.stored)
    params = loader.walk(model_spec(cfg, mtp=mtp))
    loader.check_all_used(mtp=mtp)
    return cfg, params
