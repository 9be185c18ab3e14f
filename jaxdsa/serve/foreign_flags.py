"""vLLM's and SGLang's serving flags that mean nothing to jaxdsa, or ask for what it does not do.

A deployment command written for ``vllm serve`` or ``python -m sglang.launch_server`` should start
with ``python -m serve`` in its place (the flags jaxdsa honours are spelled as theirs in
:mod:`jaxdsa.serve.cli`). Of the rest, each flag here is either *ignored*, where it tunes machinery jaxdsa
does not have and leaving it out changes nothing (one warning at start-up says so), or *refused*,
where it asks for a capability jaxdsa lacks, so that a command never silently serves something
else than what it says. ``docs/serving.md`` lists every flag with what happens to it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Foreign:
    """One flag of vLLM or SGLang that jaxdsa has no use for: its spellings (``names``, aliases of
    one flag), whether it takes a value, whether it is refused or ignored, and why (shown in
    ``--help`` and at start-up)."""

    names: tuple[str, ...]
    takes_value: bool
    refused: bool  # True: the server does not start; False: a warning, then it starts
    why: str
    harmless: tuple[str, ...] = ()  # values that ask for what jaxdsa does anyway (no warning)


def _dest(name: str) -> str:
    return "foreign_" + name.lstrip("-").replace("-", "_")


def _each(names: tuple[str, ...], takes_value: bool, refused: bool, why: str, **kw) -> tuple[Foreign, ...]:
    """Flags that are distinct (not aliases) but share a verdict and its reason."""
    return tuple(Foreign((name,), takes_value, refused, why, **kw) for name in names)


_ONE_HOST = "the server runs on one host; multi-node serving is not supported"
_ATTENTION = "attention runs jaxdsa's own sparse MLA kernels on every GPU"
_KT_FORMAT = (
    "host experts run in their checkpoint's own format on jaxdsa's CPU kernel (--num-gpu-experts); "
    "there is no AMX conversion"
)

FOREIGN: tuple[Foreign, ...] = (
    # ignored: tuning of machinery jaxdsa does not have
    Foreign(("--enforce-eager",), False, False, "there is no eager mode: XLA compiles every step whole"),
    Foreign(
        ("--compilation-config", "-O"),
        True,
        False,
        "XLA compiles each step and captures its kernels in CUDA graphs itself; no compilation knobs",
    ),
    Foreign(("--additional-config",), True, False, "platform plugin options (vLLM-Ascend's); none apply"),
    Foreign(("--distributed-executor-backend",), True, False, "one process drives every local GPU"),
    Foreign(("--safetensors-load-strategy",), True, False, "safetensors files are memory-mapped and read"),
    Foreign(("--tokenizer-mode",), True, False, "the checkpoint's tokenizer.json is used as it is"),
    *_each(("--attention-backend", "--attention-config"), True, False, _ATTENTION),
    Foreign(("--enable-chunked-prefill",), False, False, "prefill is always chunked"),
    Foreign(("--enable-mixed-chunk",), False, False, "prefill chunks always share steps with decodes"),
    Foreign(
        ("--max-total-tokens",),
        True,
        False,
        "the cache size follows --gpu-memory-utilization (or --num-pages)",
    ),
    Foreign(("--api-server-count",), True, False, "one API server process", harmless=("1",)),
    # refused: capabilities jaxdsa does not have (yet)
    Foreign(
        ("--pipeline-parallel-size", "-pp", "--pp-size"),
        True,
        True,
        "pipeline parallelism is not supported; use --tensor-parallel-size / --data-parallel-size",
        harmless=("1",),
    ),
    Foreign(("--headless",), False, True, _ONE_HOST),
    *_each(("--nnodes",), True, True, _ONE_HOST, harmless=("1",)),
    *_each(("--node-rank", "--data-parallel-rank", "--data-parallel-start-rank"), True, True, _ONE_HOST,
           harmless=("0",)),
    *_each(("--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port",
            "--dist-init-addr"), True, True, _ONE_HOST),
    # KTransformers' hybrid MoE under SGLang: --kt-num-gpu-experts and --kt-cpuinfer are
    # --num-gpu-experts and --cpu-threads (jaxdsa.serve.cli); the rest choose its converted CPU weights
    *_each(("--kt-method", "--kt-amx-method", "--kt-weight-path", "--kt-amx-weight-path"), True, False,
           _KT_FORMAT),
    Foreign(("--kt-threadpool-count",), True, False, "one thread pool; the OS places its threads",
            harmless=("1",)),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument per :data:`FOREIGN` entry, in a group of their own in ``--help``."""
    group = parser.add_argument_group(
        "flags of vLLM / SGLang with no use here (ignored with a warning) or asking for what jaxdsa "
        "does not do (refused)"
    )
    for f in FOREIGN:
        verdict = "refused" if f.refused else "ignored"
        kwargs = {"dest": _dest(f.names[0]), "help": f"{verdict}: {f.why}"}
        if f.takes_value:
            group.add_argument(*f.names, metavar="VALUE", **kwargs)
        else:
            group.add_argument(*f.names, action="store_true", **kwargs)


def given(args: argparse.Namespace) -> list[Foreign]:
    """The entries whose flag a command line set (to something else than a harmless value)."""
    return [f for f in FOREIGN if getattr(args, _dest(f.names[0])) not in (None, False, *f.harmless)]


def check(args: argparse.Namespace, warn: Callable[[str], None]) -> str | None:
    """Warn once for each ignored flag given; -> the refusals of the refused ones (None: none)."""
    refusals = []
    for f in given(args):
        if f.refused:
            refusals.append(f"{f.names[0]}: {f.why}")
        else:
            warn(f"{f.names[0]} ignored: {f.why}")
    return "; ".join(refusals) or None
