"""Compiled step executables kept on disk, so that a warm start skips tracing and lowering.

JAX's persistent compilation cache (:func:`jaxdsa.engine.engine.enable_compilation_cache`) spares a
warm start XLA's compiles, not what comes before them: tracing the model for every step shape and
lowering it to StableHLO. For the bundled model's 20 step shapes that is about 7 of a warm start's
11 seconds on two cores (3.4 s tracing, 3.8 s lowering; the compiles themselves come from the cache
in a fraction of a second). This store keeps each warmed step's executable
(``jax.experimental.serialize_executable``) under a key computed without tracing, so a warm start
loads them instead.

The key must change whenever the trace could, since a stale hit would run old code silently. As
vLLM's compile cache does, it hashes everything the trace reads: the source of ``jaxdsa`` and
``pallas_kernels``, the jax / jaxlib versions, the devices, JAX's configuration as the step is traced
(inside the model's matmul-precision context), every ``JAXDSA_*``, ``XLA_*`` and ``JAX_*``
environment variable, the runner's static description (model config, module graph, mesh, cache
axes, step options: :meth:`jaxdsa.engine.runner.ModelRunner.static_description`), the step variant
and the abstract arguments (tree structure, quantized formats included, shapes, dtypes and
shardings). Anything else misses and compiles as before. A file that does not load (truncated,
written by another jaxlib) is a miss and is logged.

Only steps XLA compiled in this process are stored: one JAX took from its persistent compilation
cache serializes without its object code on XLA:CPU (jaxlib 0.12: its stored copy loads, then fails
at the first call with "Function ... not found"), so :func:`compile_step` says which is which and
such a step is left to that cache. The store lives beside JAX's compilation cache
(``<cache dir>/jaxdsa-steps``) and is off whenever that cache is; ``JAXDSA_EXECUTABLE_CACHE=0`` turns
it off, ``JAXDSA_EXECUTABLE_CACHE=DIR`` puts it in DIR.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pathlib
import pickle
import threading
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental.serialize_executable import deserialize_and_load, serialize

log = logging.getLogger(__name__)

ENV = "JAXDSA_EXECUTABLE_CACHE"
_PACKAGES = ("jaxdsa", "pallas_kernels")  # the code a step's trace runs
_ENV_PREFIXES = ("JAXDSA_", "XLA_", "JAX_")
_NOT_TRACED = ("JAXDSA_CACHE_DIR", ENV)  # where the caches live, not what they hold
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # recorded in the compiling thread
CPU_OPTIMIZATION = "xla_backend_optimization_level"
_this_thread = threading.local()


def _note_cache_hit(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        _this_thread.cache_hit = True


jax.monitoring.register_event_listener(_note_cache_hit)


def compiler_options(platform: str) -> dict[str, int] | None:
    """XLA options for the warm-up's step compiles on ``platform``. On the CPU, XLA's LLVM backend at
    optimization level 1 instead of 3 (unless ``XLA_FLAGS`` sets the level): most of a cold start on
    a CPU is XLA compiling the step shapes, and level 1 compiled the bundled model's in about 20 %
    less time, its steps as fast and their outputs bit for bit the same (docs/serving.md,
    Start-up). Other platforms keep XLA's defaults."""
    if platform != "cpu" or CPU_OPTIMIZATION in os.environ.get("XLA_FLAGS", ""):
        return None
    return {CPU_OPTIMIZATION: 1}


def compile_step(
    lowered: jax.stages.Lowered, options: dict[str, Any] | None = None
) -> tuple[jax.stages.Compiled, bool]:
    """``lowered`` compiled with XLA ``options``, and whether XLA compiled it here (False: it came
    from JAX's persistent compilation cache, and is not to be stored: see the module docstring)."""
    _this_thread.cache_hit = False
    compiled = lowered.compile(compiler_options=options)
    return compiled, not _this_thread.cache_hit


@functools.cache
def source_digest() -> str:
    """SHA-256 of every Python file of the packages a step's trace runs (their paths and contents)."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        root = pathlib.Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment() -> str:
    """What a trace reads besides its arguments and the code: versions, devices, JAX's configuration
    as it stands now (call it inside the step's precision context) and the environment variables
    jaxdsa, XLA and JAX read."""
    env = sorted(
        (k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k not in _NOT_TRACED
    )
    config = sorted((k, repr(v)) for k, v in jax.config.values.items() if "compilation_cache" not in k)
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    return repr((jax.__version__, jaxlib.__version__, devices, env, config))


def abstract(tree: Any) -> str:
    """The tree structure and each leaf's shape, dtype and sharding: what a compiled step is
    specialized to."""
    leaves, treedef = jax.tree.flatten(tree)
    return repr(
        (str(treedef), [(np.shape(a), str(a.dtype), str(getattr(a, "sharding", None))) for a in leaves])
    )


class ExecutableStore:
    """Serialized step executables in ``directory``, one file per key (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, static: str):
        self.directory = pathlib.Path(directory)
        self.static = static

    @classmethod
    def for_runner(cls, static: str) -> ExecutableStore | None:
        """The store ``$JAXDSA_EXECUTABLE_CACHE`` names, else the one beside JAX's compilation cache;
        None where the variable is 0 or there is no compilation cache."""
        setting = os.environ.get(ENV, "")
        if setting == "0":
            return None
        if setting not in ("", "1"):
            return cls(setting, static)
        cache = jax.config.jax_compilation_cache_dir
        return cls(os.path.join(cache, "jaxdsa-steps"), static) if cache else None

    def key(self, variant: Any, args: Any) -> str:
        """The key of step ``variant`` over ``args``; call it in the context the step is traced in."""
        parts = (source_digest(), environment(), self.static, repr(variant), abstract(args))
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.executable"

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The executable stored under ``key``, or None (absent, or not loadable here: logged)."""
        path = self._path(key)
        if not path.exists():
            return None
        try:
            payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in device_ids]  # the executable's own, in its order
            return deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except Exception as exc:  # noqa: BLE001 - any failure to load is a miss, never an error
            log.warning("jaxdsa: stored step %s did not load (%s); compiling it", path.name, exc)
            return None

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Store ``compiled`` under ``key`` with the ids of the devices it runs on (a loaded executable
        otherwise takes every device of the backend), written whole, then renamed into place: a
        reader never sees half a file. A failure is logged; the step runs all the same."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            data = pickle.dumps((*serialize(compiled), device_ids))
            tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(self._path(key))
        except Exception as exc:  # noqa: BLE001
            log.warning("jaxdsa: could not store a compiled step (%s)", exc)
