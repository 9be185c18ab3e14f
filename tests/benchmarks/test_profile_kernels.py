"""The Nsight Compute log summary of benchmarks/profile_kernels.py (no GPU needed)."""

from __future__ import annotations

from benchmarks.profile_kernels import summarize

_LOG = """\
==PROF== Connected to process 457 (/usr/bin/python3.12)
==PROF== Profiling "sparse_mla" - 0: 0%....50%....100% - 18 passes
==PROF== Profiling "merge_states" - 1: 0%....50%....100% - 18 passes
profile_kernels: mla_h16_b1: 10.0 us per call (one input set, L2-warm)
==PROF== Profiling "DeviceRadixSortOnesweepKernel" - 2: 0%....50%....100% - 18 passes
profile_kernels: moe_t4096: 9000.0 us per call (one input set, L2-warm)
==PROF== Disconnected from process 457
  sparse_mla (1, 64, 1)x(256, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    DRAM Throughput                   %         9.15
    Duration                         us         7.84
    Section: Launch Statistics
    Registers Per Thread             register/thread               255
    Section: Memory Workload Analysis
    Local Memory Spilling Requests                          266,240
  merge_states (16, 8, 1)x(128, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Duration                         us         6.27
  void cub::DeviceRadixSortOnesweepKernel<cub::policy_hub<int>::Policy1000, 0>(T5 *, int) (6, 1, 1)x(384, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Duration                         us        10.59
    Achieved Occupancy                        %        18.87
"""  # noqa: E501 (verbatim Nsight Compute log line)


def test_one_row_per_kernel_with_its_case_and_metrics():
    rows = summarize(_LOG)
    assert [(r["case"], r["kernel"], r["grid"], r["threads"]) for r in rows] == [
        ("mla_h16_b1", "sparse_mla", "1,64,1", 256),
        ("mla_h16_b1", "merge_states", "16,8,1", 128),
        ("moe_t4096", "cub::DeviceRadixSortOnesweepKernel", "6,1,1", 384),
    ]
    assert rows[0]["duration"] == "7.84 us" and rows[0]["regs"] == "255"
    assert rows[0]["spill requests"] == "266240" and rows[0]["DRAM % of peak"] == "9.15"
    assert rows[2]["occupancy % (achieved)"] == "18.87"
