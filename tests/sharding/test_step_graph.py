"""What the compiled step looks like on a TP mesh, where it decides how the GPU runs it.

XLA's GPU backend runs a conditional inside a CUDA graph only when its branches hold nothing a
graph cannot capture, collectives included; otherwise the host reads the predicate, which stalls
the launching of every step until the device reaches it. The sampler's fallback to a full sort is
such a conditional, so the step must hand it logits that need no collective.
"""

from __future__ import annotations

import re

import jaxdsa
from checkpoints.tiny.make import make_tiny
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
