"""The Nsight Compute log summary of benchmarks/profile_kernels.py (no GPU needed)."""

from __future__ import annotations

from benchmarks.profile_kernels import summarize, summarize_sass

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


_SASS = """\
"Kernel Name","moe_gate_up",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_wait (Not Issued)","stall_selected"
"0x7f00","      LDS.U8 R50, [R60+UR10+0x800]","9","60","6","2","3"
"0x7f10","@P2   PRMT R41, R74, 0x3340, R57","3","20","1","1","2"
"0x7f20","      HMMA.16816.F32.BF16 R4, R8, R12, R4","2","10","0","0","2"
"0x7f30","      IMAD.WIDE R48, R45, 0x2, R22","1","10","1","0","0"
"Kernel Name","moe_down",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_wait (Not Issued)","stall_selected"
"0x7e00","      BPT.TRAP 0x1","0","4","0","0","0"
"0x7e10","      HGMMA.64x16x16.F32.BF16 R24, gdesc[UR4], R24","5","12","4","4","1"
"""  # noqa: E501 (verbatim ncu CSV header)


def test_sass_mix_per_kernel_with_kinds_opcodes_and_stalls():
    rows = summarize_sass(_SASS, ["moe_int4_t1", "moe_int4_t1"])
    assert [(r["case"], r["kernel"], r["warp instructions"]) for r in rows] == [
        ("moe_int4_t1", "moe_gate_up", 100),
        ("moe_int4_t1", "moe_down", 16),
    ]
    gate_up, down = rows
    assert gate_up["shared-memory loads / stores"] == 60.0 and gate_up["bit ops / packed 16-bit math"] == 20.0
    assert gate_up["tensor cores"] == 10.0 and gate_up["integer / address / moves"] == 10.0
    assert gate_up["top opcodes (% of instructions)"].startswith(
        "LDS.U8 60.0, PRMT 20.0"
    )  # predicate dropped
    assert gate_up["top stalls (% of samples)"] == "wait 53, selected 47"  # "(Not Issued)" columns left out
    assert down["other"] == 25.0 and down["tensor cores"] == 75.0
