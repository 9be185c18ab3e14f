"""Load a Hugging Face checkpoint directory into jaxdsa's params pytree.

Tensors are memory-mapped and converted one at a time (dequantizing FP8-block or INT4-packed
weights in float32 first), so host memory holds one tensor (or one layer's experts) at a time.
Every failure names the file and the tensor.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from checkpoints import names
from checkpoints.errors import CheckpointError
from checkpoints.quant import dequantize_fp8_block, dequantize_int4_packed
from checkpoints.safetensors_io import CheckpointReader
from jaxdsa import ops
from jaxdsa.config import ModelConfig, load_config

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


class _Loader:
    def __init__(self, reader: CheckpointReader, cfg: ModelConfig, dtype):
        self.reader, self.cfg, self.dtype = reader, cfg, dtype

    def _fail(self, tensor: str, message: str) -> CheckpointError:
        return CheckpointError(self.reader.file_of(tensor), tensor, message)

    def _plain(self, tensor: str, shape: tuple[int, ...]) -> np.ndarray:
        got = self.reader.shape(tensor)
        if got != tuple(shape):
            raise self._fail(tensor, f"shape {list(got)} != expected {list(shape)}")
        if self.reader.dtype(tensor) not in _FLOATS:
            raise self._fail(tensor, f"dtype {self.reader.dtype(tensor)} is not a float type")
        return self.reader.get(tensor)

    def linear(self, spec: names.Linear) -> np.ndarray:
        """The float32 [out, in] matrix of an HF linear layer, dequantized if needed."""
        weight, packed = spec.name + ".weight", spec.name + ".weight_packed"
        quant = self.cfg.quantization
        if weight not in self.reader and packed in self.reader:
            if quant is None or quant.method != "compressed-tensors":
                raise self._fail(packed, "INT4-packed weight but config.json has no compressed-tensors quantization_config")
            return self._int4(spec, quant.group_size)
        if weight not in self.reader:
            raise CheckpointError(self.reader.directory, weight, "missing from the checkpoint")
        if self.reader.dtype(weight) == np.dtype(ml_dtypes.float8_e4m3fn):
            if quant is None or quant.method != "fp8":
                raise self._fail(weight, "float8 weight but config.json has no fp8 quantization_config")
            scale_name = spec.name + ".weight_scale_inv"
            if scale_name not in self.reader:
                raise CheckpointError(self.reader.directory, scale_name, f"missing: needed to dequantize {weight}")
            w = self.reader.get(weight)
            if w.shape != (spec.out, spec.inp):
                raise self._fail(weight, f"shape {list(w.shape)} != expected {[spec.out, spec.inp]}")
            try:
                return dequantize_fp8_block(w, self.reader.get(scale_name), quant.weight_block_size)
            except ValueError as e:
                raise self._fail(scale_name, str(e)) from None
        return np.asarray(self._plain(weight, (spec.out, spec.inp)), np.float32)

    def _int4(self, spec: names.Linear, group: int) -> np.ndarray:
        base = spec.name
        shape_name = base + ".weight_shape"
        if shape_name in self.reader:
            shape = tuple(int(s) for s in self.reader.get(shape_name))
            if shape != (spec.out, spec.inp):
                raise self._fail(shape_name, f"{list(shape)} != expected {[spec.out, spec.inp]}")
        zp_name = base + ".weight_zero_point"
        symmetric = self.cfg.quantization.symmetric
        if not symmetric and zp_name not in self.reader:
            raise CheckpointError(self.reader.directory, zp_name, "missing: the scheme is asymmetric")
        try:
            return dequantize_int4_packed(
                self.reader.get(base + ".weight_packed"),
                self.reader.get(base + ".weight_scale"),
                None if symmetric else self.reader.get(zp_name),
                (spec.out, spec.inp),
                group,
            )
        except ValueError as e:
            raise self._fail(base + ".weight_packed", str(e)) from None

    def to_device(self, value: np.ndarray, keep_fp32: bool) -> jax.Array:
        return jnp.asarray(value, jnp.float32 if keep_fp32 else self.dtype)

    def experts(self, spec: names.Experts) -> Any:
        fused_gate_up = spec.prefix + ".gate_up_proj"
        if f"{spec.prefix}.0.gate_proj.weight" not in self.reader and fused_gate_up in self.reader:
            # transformers 5.x in-memory layout: gate_up [E, 2N, D] (gate rows first), down [E, D, N].
            gate_up = np.asarray(self._plain(fused_gate_up, (spec.num, 2 * spec.inter, spec.hidden)), np.float32)
            down = np.asarray(self._plain(spec.prefix + ".down_proj", (spec.num, spec.hidden, spec.inter)), np.float32)
            gate, up = gate_up[:, : spec.inter], gate_up[:, spec.inter :]
        else:
            stack = lambda proj, out, inp: np.stack(  # noqa: E731
                [self.linear(names.Linear(f"{spec.prefix}.{e}.{proj}", out, inp)) for e in range(spec.num)]
            )
            gate = stack("gate_proj", spec.inter, spec.hidden)
            up = stack("up_proj", spec.inter, spec.hidden)
            down = stack("down_proj", spec.hidden, spec.inter)
        return ops.pack_experts(*(jnp.asarray(a, self.dtype) for a in (gate, up, down)))

    def load(self, tree: Any) -> Any:
        if isinstance(tree, dict):
            return {k: self.load(v) for k, v in tree.items()}
        if isinstance(tree, names.Linear):
            return self.to_device(tree.post(self.linear(tree)), tree.keep_fp32)
        if isinstance(tree, names.Tensor):
            return self.to_device(np.asarray(self._plain(tree.name, tree.shape), np.float32), tree.keep_fp32)
        if isinstance(tree, names.Experts):
            return self.experts(tree)
        raise TypeError(f"unknown spec {tree!r}")


def _progress(done: int, total: int, start: float, enabled: bool) -> None:
    if enabled:
        end = "\n" if done == total else ""
        print(f"\rloading weights: {done}/{total} layers ({time.perf_counter() - start:.1f}s)", end=end, file=sys.stderr, flush=True)


def load_params(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    *,
    dtype=jnp.bfloat16,
    mtp: bool = True,
    progress: bool = True,
) -> tuple[ModelConfig, dict]:
    """Read config.json and the safetensors of ``path`` -> (config, params).

    ``mtp``: also load the next-n prediction layers when the checkpoint ships them.
    """
    path = os.fspath(path)
    cfg = cfg or load_config(path)
    reader = CheckpointReader(path)
    loader = _Loader(reader, cfg, dtype)
    mtp_layers = [
        i
        for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
        if mtp and names.mtp_marker(i) in reader
    ]
    total = cfg.num_hidden_layers + len(mtp_layers)
    start = time.perf_counter()
    params = loader.load(names.model_map(cfg))
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"].T
    params["layers"] = []
    for i in range(cfg.num_hidden_layers):
        params["layers"].append(loader.load(names.layer_map(cfg, i)))
        _progress(i + 1, total, start, progress)
    if mtp_layers:
        params["mtp"] = []
        for n, i in enumerate(mtp_layers):
            params["mtp"].append(loader.load(names.mtp_map(cfg, i)))
            _progress(cfg.num_hidden_layers + n + 1, total, start, progress)
    return cfg, params
