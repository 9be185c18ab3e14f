"""What the compiled step looks like on a TP mesh, where it decides how the GPU runs it.

XLA's GPU backend runs a conditional inside a CUDA graph only when its branches hold nothing a
graph cannot capture, collectives included; otherwise the host reads the predicate, which stalls
the launching of every step until the device reaches it. The sampler's fallback to a full sort is
such a conditional, so the step must hand it logits that need no collective.

Every all-reduce is a launch outside the CUDA graphs, with small kernels of its own around it, so
a decoder layer has exactly two: after attention and after the MLP, where the routed and the
shared experts' partial sums are added first.
"""

from __future__ import annotations

import json
import re

import jaxdsa
from jaxdsa.checkpoints.tiny.make import make_tiny
from jaxdsa.checkpoints.tiny.presets import TINY_PRESETS
from jaxdsa.engine import sampling

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _computations(hlo: str) -> dict[str, str]:
    """Each computation's body in an HLO module's text, by name."""
    return {
        m.group(1): m.group(2)
        for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M)
    }


def _reachable(bodies: dict[str, str], names: list[str]) -> set[str]:
    """Computations ``names`` call, transitively (fusions, reductions, nested control flow)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in seen and name in bodies:
            seen.add(name)
            todo += [ref for ref in re.findall(r"%([\w.\-]+)", bodies[name]) if ref in bodies]
    return seen


def test_no_collective_inside_the_samplers_conditional_at_tp2(tmp_path, monkeypatch):
    # the tiny vocabulary (512) is below the sampler's candidates: fewer, so the fallback exists
    monkeypatch.setitem(sampling.process.__kwdefaults__, "candidates", 128)
    monkeypatch.setitem(sampling.sample.__kwdefaults__, "candidates", 128)
    path = make_tiny("glm_moe_dsa", str(tmp_path), seed=7, preset="glm52", overrides={"num_hidden_layers": 2})
    llm = jaxdsa.LLM(
        path, dtype="float32", page_size=8, progress=False, max_model_len=64, max_num_seqs=2,
        max_num_batched_tokens=8, tp=2,
    )  # fmt: skip
    runner = llm.engine.runner
    fn, args = runner._step(runner.packer.padding(1, runner.modes[0]), False)
    hlo = fn.lower(*args).compile().as_text()
    bodies = _computations(hlo)
    branches = [
        b.strip().lstrip("%")
        for group in re.findall(r" conditional\([^\n]*branch_computations=\{([^}]*)\}", hlo)
        for b in group.split(",")
    ]
    assert branches, "the step has no conditional: the test no longer looks at the sampler's fallback"
    inside = _reachable(bodies, branches)
    found = {op for name in inside for op in COLLECTIVES if f" {op}(" in bodies[name]}
    assert not found, f"collectives inside the step's conditional: {sorted(found)}"
    assert any(f" {op}(" in hlo for op in COLLECTIVES)  # the mesh does split the step (a real tp = 2)


def test_one_all_reduce_per_sublayer_at_tp2(tmp_path):
    """INT4 weights (row-parallel projections through the quantized kernels) at tp=2, decode: the
    embedding's all-reduce plus two per layer, each of one array. Summing the routed and shared
    experts' outputs after their own all-reduces made XLA combine those two into one all-reduce
    of a tuple, which the GPU backend runs as a concatenation, an NCCL all-reduce and two slices."""
    layers = 3  # one dense layer, two MoE layers
    wide = {
        "hidden_size": 512,
        "moe_intermediate_size": 256,
        "n_routed_experts": 32,
        "intermediate_size": 512,
        "v_head_dim": 64,  # o_proj's K = 4 heads x 64: whole 32-row INT4 chunks per shard
    }
    config = {**TINY_PRESETS["glm52"], **wide, "vocab_size": 1024, "num_hidden_layers": layers}
    (tmp_path / "config.json").write_text(json.dumps({**config, "first_k_dense_replace": 1}))
    llm = jaxdsa.LLM(
        tmp_path, dtype="bfloat16", load_format="dummy", quantization="int4", page_size=8, progress=False,
        max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8, tp=2,
    )  # fmt: skip
    runner = llm.engine.runner
    fn, args = runner._step(runner.packer.padding(1, runner.modes[0]), False)
    hlo = fn.lower(*args).compile().as_text()
    reduces = [line for line in hlo.splitlines() if re.search(r" all-reduce(-start)?\(", line)]
    tuples = [line.strip()[:120] for line in reduces if re.search(r"= \(", line)]
    assert not tuples, f"all-reduces of several arrays: {tuples}"
    assert len(reduces) == 1 + 2 * layers, [line.strip()[:120] for line in reduces]
