"""A decode step's anatomy from a ``jax.profiler`` trace: launches, busy time, idle time inside a
step and between steps, and time by kernel kind, per step on one device.

Input: the ``perfetto_trace.json.gz`` that ``jax.profiler.trace(dir, create_perfetto_trace=True)``
writes. The device's kernels (complete events of the processes named after the device) are
assigned to steps in one of two ways:

* by launch: each engine step is an annotated range on the host
  (:data:`jaxdsa.engine.engine.STEP_MARK`); a kernel whose launch (the host API event with its
  correlation id) falls in the k-th range belongs to the step launched there. This holds under
  async scheduling, where one step's kernels start right after the last one's and no idle gap
  separates them;
* by gaps, when the trace has no such marks or no correlation ids: kernels separated by more than
  ``gap_ms`` of idle time start a new step, and groups of fewer than ``min_kernels`` are dropped
  (a synchronous engine's steps, separated by its host work).

A step's span runs from its first kernel's start to its last kernel's end; busy is the union of
its kernels' intervals (overlapping streams counted once); idle inside = span - busy; idle between
= from one step's end to the next one's start (0 where they overlap); time per token = the mean
distance between consecutive steps' starts.

The host side of the same device, where the trace has it (:func:`host_launching`): XLA launches a
step's work on one host thread per device (``[N] GpuExecutable::ExecuteThunks``); per execution of
the step, how long that took, how much of it waited in conditionals whose predicate the host reads
(their branches could not go into a CUDA graph), and how many CUDA graphs it launched. A launch
thread slower than the device's busy time is what bounds the step.

    python -m benchmarks.anatomy TRACE.json.gz [--device /device:GPU:0] [--skip 1]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import statistics
from typing import Any

from jaxdsa.engine.engine import STEP_MARK

# Kernel kinds by name (first match wins), the categories the decode issues report.
KINDS = (
    ("MoE experts", ("moe",)),
    ("quantized linears", ("quant_matmul",)),
    (
        "collectives",
        ("nccl", "all_reduce", "all-reduce", "allreduce", "all_gather", "allgather", "reduce_scatter"),
    ),
    ("attention (sparse MLA, merge)", ("sparse_mla", "merge_states")),
    ("hyper-connections (hc_pre / hc_post)", ("hc_pre", "hc_post")),
    ("V4 compressor pooling", ("compress_pool",)),
    ("indexer / top-k", ("indexer", "topk")),
    ("copies / memsets", ("memcpy", "memset")),
)
OTHER = "XLA fusions and other kernels"


def kind(name: str) -> str:
    low = name.lower()
    return next((label for label, keys in KINDS if any(k in low for k in keys)), OTHER)


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        trace = json.load(fh)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _processes(events) -> dict[int, str]:
    return {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }


def _correlation(e: dict) -> Any:
    args = e.get("args") or {}
    return args.get("correlation_id", args.get("correlation id"))


def device_kernels(events, device: str) -> list[dict]:
    pids = {pid for pid, name in _processes(events).items() if name.startswith(device)}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in pids]
    return sorted(kernels, key=lambda e: e["ts"])


def steps_by_launch(events, kernels: list[dict]) -> list[list[dict]] | None:
    """Kernels grouped by the annotated step that launched them; None if the trace cannot say."""
    marks = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("name") == STEP_MARK)
    groups = launched_in(events, kernels, marks)
    if groups is None or sum(map(len, groups)) < len(kernels) // 2:
        return None
    return [s for s in groups if s]


def launched_in(events, kernels: list[dict], ranges: list[tuple[float, float]]) -> list[list[dict]] | None:
    """``kernels`` by the host time range (sorted, disjoint ``(start, end)`` in the trace's
    microseconds) in which each was launched: the host API event that shares its correlation id
    falls inside it. Kernels launched elsewhere are left out; None when the trace has no ranges or
    no correlation ids."""
    device_pids = {k["pid"] for k in kernels}
    launches = {
        _correlation(e): e["ts"]
        for e in events
        if e.get("ph") == "X" and e.get("pid") not in device_pids and _correlation(e) is not None
    }
    if not ranges or not launches:
        return None
    starts = [r[0] for r in ranges]
    groups: list[list[dict]] = [[] for _ in ranges]
    for k in kernels:
        launched = launches.get(_correlation(k))
        if launched is None:
            continue
        i = bisect.bisect_right(starts, launched) - 1
        if i >= 0 and launched <= ranges[i][1]:
            groups[i].append(k)
    return groups


def steps_by_gaps(kernels: list[dict], gap_ms: float, min_kernels: int) -> list[list[dict]]:
    groups = [[kernels[0]]] if kernels else []
    for previous, k in zip(kernels, kernels[1:]):
        if k["ts"] - (previous["ts"] + previous.get("dur", 0)) > gap_ms * 1e3:
            groups.append([])
        groups[-1].append(k)
    return [g for g in groups if len(g) >= min_kernels]


def _busy(kernels: list[dict]) -> float:
    """Microseconds covered by at least one kernel (streams that overlap count once)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = k["ts"], k["ts"] + k.get("dur", 0)
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def anatomy(
    events, *, device: str = "/device:GPU:0", skip: int = 1, gap_ms: float = 1.0, min_kernels: int = 200
) -> dict[str, Any]:
    """Per-step means over the traced steps after the first ``skip`` (ms, launches) and by kind."""
    kernels = device_kernels(events, device)
    if not kernels:
        raise ValueError(f"no kernels of {device} in the trace")
    steps, method = steps_by_launch(events, kernels), "launch"
    if steps is None:
        steps, method = steps_by_gaps(kernels, gap_ms, min_kernels), f"gaps > {gap_ms} ms"
    steps = steps[skip:]
    if len(steps) < 2:
        raise ValueError(f"{len(steps)} step(s) found after skipping {skip}: trace more steps")
    first = [s[0]["ts"] for s in steps]
    last = [max(k["ts"] + k.get("dur", 0) for k in s) for s in steps]
    spans = [b - a for a, b in zip(first, last)]
    busy = [_busy(s) for s in steps]
    between = [max(0.0, nxt - end) for end, nxt in zip(last, first[1:])]
    n = len(steps)
    by_kind_us, by_kind_launches = collections.Counter(), collections.Counter()
    for s in steps:
        for k in s:
            by_kind_us[kind(k["name"])] += k.get("dur", 0)
            by_kind_launches[kind(k["name"])] += 1
    ms = lambda us: us / 1e3  # noqa: E731
    period = (first[-1] - first[0]) / (n - 1)
    flat = [k for s in steps for k in s]
    return {
        "host": host_launching(events, device, (first[0] - period, last[-1])),
        "graph_nodes": graph_nodes(flat),
        "in_graphs": sum("cuda_graph_id" in k.get("args", {}) for k in flat) / len(flat),
        "by_name": by_name(steps),
        "steps": n,
        "step_boundaries": method,
        "launches_per_step": sum(len(s) for s in steps) / n,
        "step_ms": ms(statistics.mean(spans)),
        "busy_ms": ms(statistics.mean(busy)),
        "idle_inside_ms": ms(statistics.mean(sp - b for sp, b in zip(spans, busy))),
        "idle_between_ms": ms(statistics.mean(between)),
        "time_per_step_ms": ms((first[-1] - first[0]) / (n - 1)),
        "by_kind": {
            label: {
                "ms_per_step": ms(us / n),
                "launches_per_step": by_kind_launches[label] / n,
                "us_each": us / by_kind_launches[label],
            }
            for label, us in by_kind_us.most_common()
        },
    }


def _contains(outer: dict, inner: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner.get("dur", 0) <= outer["ts"] + outer.get(
        "dur", 0
    )


def host_launching(events, device: str, window: tuple[float, float]) -> dict[str, float] | None:
    """Means per execution of a step launched in ``window`` (us) on ``device``'s launch thread: the
    launching (ms), the time in host-read conditionals (ms), CUDA graphs launched and their
    microseconds each; None when the trace has no such thread (a CPU run, a synthetic trace)."""
    index = device.rsplit(":", 1)[-1]
    runs = [
        e for e in events if e.get("ph") == "X" and e.get("name") == f"[{index}] GpuExecutable::ExecuteThunks"
    ]
    if not runs:
        return None
    thread = (runs[0]["pid"], runs[0]["tid"])
    mine = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) == thread]
    steps = [e for e in mine if "fused_step" in e["name"] and e["name"].endswith("XLA GPU module")]
    steps = [e for e in steps if window[0] <= e["ts"] < window[1]]
    if not steps:
        return None
    named = lambda name: [e for e in mine if e["name"] == name]  # noqa: E731
    inside = lambda kind: [e for e in kind if any(_contains(s, e) for s in steps)]  # noqa: E731
    conditional, graphs = inside(named("conditional")), inside(named("command_buffer::execute"))
    updates = inside(named("command_buffer::update"))
    n = len(steps)
    return {
        "launch_ms": statistics.mean(e["dur"] for e in steps) / 1e3,
        "conditional_wait_ms": sum(e["dur"] for e in conditional) / n / 1e3,
        "graph_launches": len(graphs) / n,
        "graph_launch_us": statistics.mean(e["dur"] for e in graphs) if graphs else 0.0,
        "graph_updates": len(updates) / n,
        "graph_update_ms": sum(e["dur"] for e in updates) / n / 1e3,
    }


def graph_nodes(kernels: list[dict]) -> float:
    """Mean kernels per CUDA-graph launch (one launch = one correlation id of one graph): the host's
    cost of a graph launch grows with it."""
    launches = collections.Counter(
        (k["args"]["cuda_graph_id"], _correlation(k)) for k in kernels if "cuda_graph_id" in k.get("args", {})
    )
    return statistics.mean(launches.values()) if launches else 0.0


def by_name(steps: list[list[dict]], top: int = 60) -> list[dict[str, Any]]:
    """The kernels that take most time per step, by name: launches and microseconds per step, and
    the share launched inside CUDA graphs. Fusion names are XLA's (``loop_add_fusion_3``); what a
    fusion holds is in the step's optimized HLO."""
    us, count, graphed = collections.Counter(), collections.Counter(), collections.Counter()
    for s in steps:
        for k in s:
            us[k["name"]] += k.get("dur", 0)
            count[k["name"]] += 1
            graphed[k["name"]] += "cuda_graph_id" in k.get("args", {})
    n = len(steps)
    return [
        {
            "name": name,
            "launches_per_step": count[name] / n,
            "us_per_step": t / n,
            "in_graphs": graphed[name] / count[name],
        }
        for name, t in us.most_common(top)
    ]


def lines(result: dict[str, Any]) -> list[str]:
    """The anatomy as text, one line per kind (or its ``error``)."""
    r = result
    if "error" in r:
        return [r["error"]]
    out = [
        f"{r['steps']} steps (boundaries by {r['step_boundaries']}): "
        f"{r['launches_per_step']:.0f} kernels/step; "
        f"step {r['step_ms']:.2f} ms = busy {r['busy_ms']:.2f} + idle inside {r['idle_inside_ms']:.2f}; "
        f"idle between steps {r['idle_between_ms']:.2f} ms; time per step {r['time_per_step_ms']:.2f} ms"
    ]
    for label, k in r["by_kind"].items():
        out.append(
            f"  {label:38s} {k['ms_per_step']:7.2f} ms/step {k['launches_per_step']:7.0f} launches/step "
            f"{k['us_each']:7.1f} us each"
        )
    if r.get("host"):
        h = r["host"]
        out.append(
            f"host, this device's launch thread: {h['launch_ms']:.2f} ms per step, of which "
            f"{h['conditional_wait_ms']:.2f} ms waiting in host-read conditionals; "
            f"{h['graph_launches']:.0f} CUDA graphs launched, {h['graph_launch_us']:.1f} us each "
            f"({r.get('graph_nodes', 0):.1f} kernels each; {100 * r.get('in_graphs', 0):.0f} % of kernels in "
            f"graphs), {h.get('graph_updates', 0):.0f} graph updates ({h.get('graph_update_ms', 0):.2f} ms)"
        )
    return out


def name_lines(result: dict[str, Any], top: int = 40) -> list[str]:
    """The ``by_name`` table as text: the kernels that take most time per step."""
    rows = result.get("by_name", [])[:top]
    return [
        f"  {r['us_per_step']:8.1f} us/step {r['launches_per_step']:6.1f} launches/step "
        f"{100 * r['in_graphs']:4.0f} % in graphs  {r['name'][:90]}"
        for r in rows
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--device", default="/device:GPU:0")
    p.add_argument("--skip", type=int, default=1, help="leading steps to leave out (a prefill, say)")
    p.add_argument("--gap-ms", type=float, default=1.0)
    p.add_argument("--min-kernels", type=int, default=200)
    p.add_argument("--names", type=int, default=0, help="also list the N kernels that take most time")
    a = p.parse_args()
    result = anatomy(load(a.trace), device=a.device, skip=a.skip, gap_ms=a.gap_ms, min_kernels=a.min_kernels)
    print("\n".join(lines(result) + (name_lines(result, a.names) if a.names else [])))


if __name__ == "__main__":
    main()
