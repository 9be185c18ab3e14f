"""Compile size does not grow with depth: layers of one kind run under one scan.

The step is lowered (never compiled or run) on abstract parameters, so a 78-layer model costs no
memory; the StableHLO text is the measure of what XLA has to compile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxdsa.cache import StepMeta, init_cache
from jaxdsa.models import family as families
from jaxdsa.models.layer_groups import LayerGroup, ScannedLayers, group_layers
from jaxdsa.models.registry import family_for, tiny_config

PAGE, PAGES, T = 8, 4, 8


def indexer_types(layers: int, pattern: tuple[str, ...]) -> list[str]:
    return [pattern[i % len(pattern)] for i in range(layers)]


def lowered_size(preset: str, layers: int, *, sparse: bool) -> int:
    """Characters of the lowered decode/prefill step (absorbed attention, ``sparse`` mode)."""
    overrides: dict = {"num_hidden_layers": layers}
    if preset == "glm5":
        overrides["indexer_types"] = ["full"] * layers
    cfg = tiny_config(preset, **overrides)
    family = family_for(cfg.model_type)
    model = families.abstract(family, cfg, dtype=jnp.float32, parallelism=None, mtp=0)
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: init_cache(family.cache_spec(cfg), PAGES, PAGE, jnp.float32))
    meta = StepMeta(
        seq_ids=jax.ShapeDtypeStruct((T,), jnp.int32),
        page_table=jax.ShapeDtypeStruct((2, PAGES), jnp.int32),
        logits_indices=jax.ShapeDtypeStruct((2,), jnp.int32),
    )
    tokens = jax.ShapeDtypeStruct((T,), jnp.int32)
    mode = family.step_mode(cfg, max_position=cfg.index_topk if sparse else 0)

    def step(state, tokens, positions, cache, meta):
        return family.step(nnx.merge(graphdef, state), tokens, positions, cache, meta, mode)

    return len(jax.jit(step).lower(state, tokens, tokens, cache, meta).as_text())


@pytest.mark.parametrize("preset", ["glm5", "dsv32"])
@pytest.mark.parametrize("sparse", [False, True])
def test_step_size_independent_of_depth(preset, sparse):
    shallow, deep = lowered_size(preset, 4, sparse=sparse), lowered_size(preset, 78, sparse=sparse)
    assert deep <= 1.5 * shallow, (shallow, deep)


def test_glm52_pattern_scans_as_groups():
    """78 layers of GLM-5.2's pattern: the dense prefix, one scanned group of (full + 3 shared)
    MoE blocks, and the remainder; never one module per layer."""
    cfg = tiny_config(
        "glm52", num_hidden_layers=78, indexer_types=indexer_types(78, ("full", "shared", "shared", "shared"))
    )
    family = family_for(cfg.model_type)
    model = families.abstract(family, cfg, dtype=jnp.float32, parallelism=None, mtp=0)
    scanned = [g.group for g in model.groups if isinstance(g, ScannedLayers)]
    assert sum(g.period * g.repeats for g in scanned if g.repeats > 1) >= 72, scanned
    assert len(model.groups) <= 4, scanned


def test_group_layers():
    glm5 = ["dense"] * 3 + ["moe"] * 75
    assert group_layers(glm5) == [LayerGroup(0, 1, 3), LayerGroup(3, 1, 75)]
    pattern = ["d"] * 3 + ["full", "shared", "shared", "shared"] * 18 + ["full", "shared", "shared"]
    assert group_layers(pattern) == [
        LayerGroup(0, 1, 3),
        LayerGroup(3, 4, 18),
        LayerGroup(75, 1, 1),
        LayerGroup(76, 1, 2),
    ]
    assert group_layers(["a", "b", "c"]) == [LayerGroup(i, 1, 1) for i in range(3)]  # nothing repeats


def test_unrolled_layers_compute_the_same_model():
    """``scan_layers=False``: one module per layer, loaded from the same files, the same logits."""
    import numpy as np

    import jaxdsa
    from jaxdsa.models.layer_groups import UnrolledLayers
    from tests.conftest import FIXTURES

    kw = dict(dtype="float32", page_size=8, progress=False, max_model_len=64)
    scanned = jaxdsa.LLM(FIXTURES / "glm52", scan_layers=True, **kw)
    unrolled = jaxdsa.LLM(FIXTURES / "glm52", scan_layers=False, **kw)
    assert [type(g) for g in unrolled.model.groups] == [UnrolledLayers]
    assert len(unrolled.model.groups[0].layers) == unrolled.config.num_hidden_layers
    prompt = np.load(FIXTURES / "glm52" / "golden.npz")["prompt_long"].tolist()
    np.testing.assert_allclose(unrolled.score(prompt), scanned.score(prompt), rtol=1e-5, atol=1e-5)
    assert unrolled.generate([prompt[:8]], max_new_tokens=4) == scanned.generate(
        [prompt[:8]], max_new_tokens=4
    )
