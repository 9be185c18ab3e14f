"""benchmarks/anatomy.py on a synthetic trace whose figures are known: kernels assigned to the step
that launched them (by correlation id, also when steps overlap on the device, as under async
scheduling), busy time with overlapping streams counted once, idle time inside and between steps,
time by kernel kind; and the gap rule when the trace has no step marks."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import anatomy
from jaxdsa.engine.engine import STEP_MARK

GPU, HOST = 1, 2


def _trace(steps: list[list[tuple[str, float, float]]], launch_gap: float, marks: bool = True) -> list[dict]:
    """Steps of kernels (name, start us, duration us) on GPU 0; each kernel launched on the host
    inside its step's annotated range, ``launch_gap`` before it starts."""
    events = [
        {"ph": "M", "name": "process_name", "pid": GPU, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": HOST, "args": {"name": "/host:CPU"}},
    ]
    correlation = 0
    for kernels in steps:
        first_launch = kernels[0][1] - launch_gap
        last_launch = kernels[-1][1] - launch_gap
        if marks:
            events.append({"ph": "X", "pid": HOST, "tid": 1, "name": STEP_MARK, "ts": first_launch - 1,
                           "dur": last_launch - first_launch + 2})  # fmt: skip
        for name, start, dur in kernels:
            correlation += 1
            args = {"correlation_id": correlation}
            events.append(
                {"ph": "X", "pid": GPU, "tid": 7, "name": name, "ts": start, "dur": dur, "args": args}
            )
            launch = start - launch_gap
            events.append({"ph": "X", "pid": HOST, "tid": 1, "name": "cuLaunchKernel", "ts": launch, "dur": 1,
                           "args": args})  # fmt: skip
    return events


def _step(t0: float) -> list[tuple[str, float, float]]:
    """A 100 us step: an MoE kernel, a fusion overlapping it on another stream, an all-reduce after
    an idle gap of 20 us, a quantized linear."""
    return [
        ("moe_gate_up", t0, 40.0),
        ("loop_add_fusion", t0 + 30, 20.0),  # overlaps: busy counts 0..50 once
        ("ncclDevKernel_AllReduce", t0 + 70, 20.0),
        ("quant_matmul_3", t0 + 90, 10.0),
    ]


def test_steps_by_launch_even_when_they_touch_on_the_device(tmp_path):
    starts = [0.0, 100.0, 230.0, 330.0]  # steps 1-2 back to back, 30 us idle before step 3
    events = _trace([_step(t) for t in starts], launch_gap=500.0)
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    r = anatomy.anatomy(anatomy.load(str(path)), skip=0)
    assert r["step_boundaries"] == "launch" and r["steps"] == 4 and r["launches_per_step"] == 4
    assert r["step_ms"] == pytest.approx(0.1) and r["busy_ms"] == pytest.approx(0.08)
    assert r["idle_inside_ms"] == pytest.approx(0.02)
    assert r["idle_between_ms"] == pytest.approx((0 + 30 + 0) / 3 / 1e3)
    assert r["time_per_step_ms"] == pytest.approx(330 / 3 / 1e3)
    kinds = r["by_kind"]
    assert kinds["MoE experts"]["ms_per_step"] == pytest.approx(0.04)
    assert kinds["collectives"]["launches_per_step"] == 1 and kinds["quantized linears"]["us_each"] == 10
    assert kinds[anatomy.OTHER]["ms_per_step"] == pytest.approx(0.02)
    text = "\n".join(anatomy.lines(r))
    assert "4 steps (boundaries by launch)" in text and "MoE experts" in text


def test_without_marks_steps_split_at_idle_gaps():
    starts = [0.0, 2000.0, 4000.0]  # 1.9 ms idle between steps
    events = _trace([_step(t) for t in starts], launch_gap=5.0, marks=False)
    r = anatomy.anatomy(events, skip=1, gap_ms=1.0, min_kernels=3)
    assert r["step_boundaries"] == "gaps > 1.0 ms" and r["steps"] == 2
    assert r["idle_between_ms"] == pytest.approx(1.9)
    with pytest.raises(ValueError, match="no kernels of /device:GPU:1"):
        anatomy.anatomy(events, device="/device:GPU:1")


def test_the_devices_launch_thread_per_step():
    """Two executions of the step on device 0's launch thread, each with a conditional the host
    waited in and CUDA graphs launched; device 1's thread and other modules do not count."""
    events = _trace([_step(t) for t in (0.0, 100.0, 200.0)], launch_gap=50.0)

    def on(tid: int, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "pid": HOST, "tid": tid, "name": name, "ts": ts, "dur": dur}

    for t0 in (-60.0, 40.0):  # the launches of steps 1 and 2, inside the window
        events += [
            on(3, "[0] GpuExecutable::ExecuteThunks", t0, 90.0),
            on(3, "jit_fused_step_packed:XLA GPU module", t0, 90.0),
            on(3, "command_buffer::execute", t0 + 1, 10.0),
            on(3, "command_buffer::execute", t0 + 20, 30.0),
            on(3, "command_buffer::update", t0 + 2, 4.0),
            on(3, "conditional", t0 + 60, 25.0),
            on(4, "[1] GpuExecutable::ExecuteThunks", t0, 500.0),
            on(4, "jit_fused_step_packed:XLA GPU module", t0, 500.0),
            on(3, "jit_broadcast:XLA GPU module", t0 + 95, 3.0),
        ]
    r = anatomy.anatomy(events, skip=0)
    assert r["host"] == {
        "launch_ms": pytest.approx(0.09),
        "conditional_wait_ms": pytest.approx(0.025),
        "graph_launches": 2,
        "graph_launch_us": pytest.approx(20.0),
        "graph_updates": 1,
        "graph_update_ms": pytest.approx(0.004),
    }
    assert "host, this device's launch thread: 0.09 ms per step" in "\n".join(anatomy.lines(r))
    assert anatomy.anatomy(_trace([_step(t) for t in (0.0, 100.0)], launch_gap=5.0), skip=0)["host"] is None


def test_graph_nodes_and_the_kernels_by_name():
    """Kernels of one graph launch share a graph id and a correlation id: two launches of a 2-kernel
    graph and one kernel outside any graph per step; by name, most time first."""
    events = _trace([_step(t) for t in (0.0, 100.0, 200.0)], launch_gap=5.0)
    kernels = [e for e in events if e.get("pid") == GPU and e.get("ph") == "X"]
    for i, k in enumerate(kernels):
        if k["name"] != "ncclDevKernel_AllReduce":  # moe + fusion one launch, quant_matmul another
            launch = f"g{i // 4}-{k['name'] == 'quant_matmul_3'}"
            k["args"] |= {"cuda_graph_id": "7", "correlation_id": launch}
    r = anatomy.anatomy(events, skip=0)
    assert r["graph_nodes"] == pytest.approx(1.5) and r["in_graphs"] == pytest.approx(0.75)
    names = r["by_name"]
    assert [n["name"] for n in names][:2] == ["moe_gate_up", "loop_add_fusion"]
    assert names[0]["us_per_step"] == 40 and names[0]["launches_per_step"] == 1
    nccl = next(n for n in names if n["name"] == "ncclDevKernel_AllReduce")
    assert nccl["in_graphs"] == 0 and names[0]["in_graphs"] == 1
    assert "moe_gate_up" in anatomy.name_lines(r)[0]
