"""What a notebook does with ``llm.model``: print it, take a layer, swap a module, score again."""

from __future__ import annotations

import numpy as np
from flax import nnx

import jaxdsa
from tests.conftest import FIXTURES


class Doubled(nnx.Module):
    """A user's module wrapping the layer's own MoE: twice its output."""

    def __init__(self, inner: nnx.Module):
        self.inner = inner

    def __call__(self, x):
        return 2 * self.inner(x)


def test_print_index_swap_and_score(capsys):
    llm = jaxdsa.LLM(FIXTURES / "glm5", dtype="float32", page_size=8, progress=False, max_model_len=64)
    prompt = np.load(FIXTURES / "glm5" / "golden.npz")["prompt_short"].tolist()
    before = llm.score(prompt)

    nnx.display(llm.model)
    shown = capsys.readouterr().out
    assert "DsaModel" in shown and "MoE" in shown and "ScannedLayers" in shown

    layer = llm.model.layer(3)  # a MoE layer, taken out of its scanned stack
    # taking it out of the stack changes nothing but XLA's float rounding
    np.testing.assert_allclose(llm.score(prompt), before, rtol=1e-5, atol=1e-5)
    moe = layer.mlp
    layer.mlp = Doubled(moe)
    doubled = llm.score(prompt)
    assert np.abs(doubled - before).max() > 1e-2

    # The same change made in the weights: routed and shared down projections times two (the shared
    # expert is the stacks' last expert, jaxdsa.shared_experts, so one stack holds both)
    layer.mlp = moe
    assert moe.shared is None and moe.experts.shared_slot == llm.config.n_routed_experts
    moe.experts.down.set_value(moe.experts.down.get_value() * 2)
    np.testing.assert_allclose(llm.score(prompt), doubled, rtol=1e-5, atol=1e-5)


def test_repr_says_model_weights_mesh_and_cache():
    llm = jaxdsa.LLM(FIXTURES / "glm5", dtype="float32", page_size=8, progress=False, max_model_len=64)
    assert repr(llm).endswith(": glm_moe_dsa, 4 layers, weights float32, tp 1 ep 1 dp 1, cache not made yet)")
    pages = llm.engine.stats()["cache_pages_total"]
    assert repr(llm).endswith(f"cache {pages} pages of 8 tokens, max_model_len 64)")
