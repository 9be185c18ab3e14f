"""Load a Hugging Face checkpoint directory into jaxdsa's params pytree.

Tensors are memory-mapped and converted one at a time (FP8-block weights dequantized in float32,
INT4-packed ones in their scale's dtype as compressed-tensors does, see :mod:`checkpoints.quant`),
so host memory holds one tensor (or one layer's experts) at a time. Every failure names the file
and the tensor.
"""

from __future__ import annotations

import functools
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
from jaxdsa import ops, sharding
from jaxdsa.config import ModelConfig, load_config

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


class _Loader:
    def __init__(self, reader: CheckpointReader, cfg: ModelConfig, dtype, mesh):
        self.reader, self.cfg, self.dtype, self.mesh = reader, cfg, dtype, mesh

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
        if quant is not None and quant.method == "compressed-tensors":
            self._check_quantized_as_configured(spec.name, quant)
        if weight not in self.reader and packed in self.reader:
            if quant is None or quant.method != "compressed-tensors":
                raise self._fail(
                    packed, "INT4-packed weight but config.json has no compressed-tensors quantization_config"
                )
            return self._int4(spec, quant.group_size)
        if weight not in self.reader:
            raise CheckpointError(self.reader.directory, weight, "missing from the checkpoint")
        if self.reader.dtype(weight) == np.dtype(ml_dtypes.float8_e4m3fn):
            if quant is None or quant.method != "fp8":
                raise self._fail(weight, "float8 weight but config.json has no fp8 quantization_config")
            scale_name = spec.name + ".weight_scale_inv"
            if scale_name not in self.reader:
                raise CheckpointError(
                    self.reader.directory, scale_name, f"missing: needed to dequantize {weight}"
                )
            w = self.reader.get(weight)
            if w.shape != (spec.out, spec.inp):
                raise self._fail(weight, f"shape {list(w.shape)} != expected {[spec.out, spec.inp]}")
            try:
                return dequantize_fp8_block(w, self.reader.get(scale_name), quant.weight_block_size)
            except ValueError as e:
                raise self._fail(scale_name, str(e)) from None
        return np.asarray(self._plain(weight, (spec.out, spec.inp)), np.float32)

    def _check_quantized_as_configured(self, module: str, quant) -> None:
        """A module the config's targets / ignore list quantize must be stored packed, any other
        plainly: a file that disagrees with its config is refused rather than guessed at."""
        packed = module + ".weight_packed"
        if packed in self.reader and not quant.quantizes(module):
            raise self._fail(
                packed, "stored packed, but the quantization_config ignores it or no target matches"
            )
        if module + ".weight" in self.reader and quant.quantizes(module):
            raise self._fail(module + ".weight", "stored unpacked, but the quantization_config quantizes it")

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
            w = dequantize_int4_packed(
                self.reader.get(base + ".weight_packed"),
                self.reader.get(base + ".weight_scale"),
                None if symmetric else self.reader.get(zp_name),
                (spec.out, spec.inp),
                group,
            )
            return w.astype(np.float32)  # the library's values (bf16 for bf16 scales), exactly
        except ValueError as e:
            raise self._fail(base + ".weight_packed", str(e)) from None

    def to_device(self, value: np.ndarray, keep_fp32: bool, path: tuple) -> jax.Array:
        """Place one tensor: whole on the default device, or each device's slice on a mesh."""
        dtype = jnp.float32 if keep_fp32 else self.dtype
        if self.mesh is None:
            return jnp.asarray(value, dtype)
        logical = sharding.leaf_axes(path, value.ndim)
        value = sharding.fit_to_mesh(value, logical, self.mesh, "/".join(map(str, path)))
        target = jax.sharding.NamedSharding(self.mesh, sharding.spec(logical))
        host = np.asarray(value, dtype)
        return jax.make_array_from_callback(host.shape, target, lambda index: host[index])

    def _expert_matrices(self, spec: names.Experts, first: int, last: int):
        """HF gate [n, N, D], up [n, N, D], down [n, D, N] (float32) of experts first..last-1."""
        fused_gate_up = spec.prefix + ".gate_up_proj"
        if f"{spec.prefix}.0.gate_proj.weight" not in self.reader and fused_gate_up in self.reader:
            # transformers 5.x in-memory layout: gate_up [E, 2N, D] (gate rows first), down [E, D, N].
            gate_up = self._plain(fused_gate_up, (spec.num, 2 * spec.inter, spec.hidden))[first:last]
            down = self._plain(spec.prefix + ".down_proj", (spec.num, spec.hidden, spec.inter))[first:last]
            gate_up = np.asarray(gate_up, np.float32)
            return gate_up[:, : spec.inter], gate_up[:, spec.inter :], np.asarray(down, np.float32)
        stack = lambda proj, out, inp: np.stack(  # noqa: E731
            [self.linear(names.Linear(f"{spec.prefix}.{e}.{proj}", out, inp)) for e in range(first, last)]
        )
        return (
            stack("gate_proj", spec.inter, spec.hidden),
            stack("up_proj", spec.inter, spec.hidden),
            stack("down_proj", spec.hidden, spec.inter),
        )

    def experts(self, spec: names.Experts, path: tuple) -> Any:
        if self.mesh is None:
            gate, up, down = self._expert_matrices(spec, 0, spec.num)
            return ops.pack_experts(*(jnp.asarray(a, self.dtype) for a in (gate, up, down)))
        # Each expert shard reads only its own experts; expert-TP shards keep [gate_i | up_i]
        # column blocks together so the packed layout stays valid on every shard.
        shards = int(np.prod([self.mesh.shape[a] for a in sharding.EXPERT_AXES]))
        tpi = self.mesh.shape["tpi"]
        if spec.num % shards or spec.inter % tpi:
            raise CheckpointError(
                self.reader.directory,
                spec.prefix,
                f"{spec.num} experts x {spec.inter} do not split over {shards} x {tpi} devices",
            )
        per = spec.num // shards
        packed_parts: dict[int, dict] = {}

        def packed(index, key):
            first = index[0].start or 0
            if first not in packed_parts:
                g, u, d = self._expert_matrices(spec, first, first + per)
                g, u = sharding.expert_tp_order(g, u, tpi)
                packed_parts[first] = {
                    k: np.asarray(v) for k, v in ops.pack_experts(*map(jnp.asarray, (g, u, d))).items()
                }
                del g, u, d
            part = packed_parts[first][key]
            return np.asarray(part[(slice(None),) + tuple(index[1:])], self.dtype)

        shapes = jax.eval_shape(
            ops.pack_experts,
            *(
                jax.ShapeDtypeStruct(s, self.dtype)
                for s in (
                    (spec.num, spec.inter, spec.hidden),
                    (spec.num, spec.inter, spec.hidden),
                    (spec.num, spec.hidden, spec.inter),
                )
            ),
        )
        out = {}
        for key, shape in shapes.items():
            target = jax.sharding.NamedSharding(
                self.mesh, sharding.spec(sharding.leaf_axes(path + (key,), len(shape.shape)))
            )
            out[key] = jax.make_array_from_callback(shape.shape, target, functools.partial(packed, key=key))
        return out

    def load(self, tree: Any, path: tuple = ()) -> Any:
        if isinstance(tree, dict):
            return {k: self.load(v, path + (k,)) for k, v in tree.items()}
        if isinstance(tree, names.Linear):
            return self.to_device(tree.post(self.linear(tree)), tree.keep_fp32, path)
        if isinstance(tree, names.Tensor):
            return self.to_device(
                np.asarray(self._plain(tree.name, tree.shape), np.float32), tree.keep_fp32, path
            )
        if isinstance(tree, names.Experts):
            return self.experts(tree, path)
        raise TypeError(f"unknown spec {tree!r}")


def _progress(done: int, total: int, start: float, enabled: bool) -> None:
    if enabled:
        end = "\n" if done == total else ""
        print(
            f"\rloading weights: {done}/{total} layers ({time.perf_counter() - start:.1f}s)",
            end=end,
            file=sys.stderr,
            flush=True,
        )


def load_params(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    *,
    dtype=jnp.bfloat16,
    mtp: bool = True,
    progress: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[ModelConfig, dict]:
    """Read config.json and the safetensors of ``path`` -> (config, params).

    ``mtp``: also load the next-n prediction layers when the checkpoint ships them.
    ``mesh``: place every parameter straight into its sharded layout (jaxdsa.sharding rules).
    """
    path = os.fspath(path)
    cfg = cfg or load_config(path)
    reader = CheckpointReader(path)
    loader = _Loader(reader, cfg, dtype, mesh)
    mtp_layers = [
        i
        for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
        if mtp and names.mtp_marker(i) in reader
    ]
    total = cfg.num_hidden_layers + len(mtp_layers)
    start = time.perf_counter()
    params = loader.load(names.model_map(cfg))
    if cfg.tie_word_embeddings:
        params["lm_head"] = loader.to_device(
            np.asarray(reader.get("model.embed_tokens.weight"), np.float32).T, False, ("lm_head",)
        )
    params["layers"] = []
    for i in range(cfg.num_hidden_layers):
        params["layers"].append(loader.load(names.layer_map(cfg, i), ("layers", i)))
        _progress(i + 1, total, start, progress)
    if mtp_layers:
        params["mtp"] = []
        for n, i in enumerate(mtp_layers):
            params["mtp"].append(loader.load(names.mtp_map(cfg, i), ("mtp", n)))
            _progress(cfg.num_hidden_layers + n + 1, total, start, progress)
    return cfg, params
