"""The next-n (MTP) layer: loaded from layer num_hidden_layers and run by ``DsaModel.draft``.

HF transformers drops these weights on load, so there is no HF oracle; the glue around the
decoder block (enorm / hnorm, embedding-first concat, eh_proj, shared_head.norm, shared lm_head)
is checked against the formula of docs/models.md §2.12 with tensors read straight from the file. The
block itself is the HF-verified decoder layer.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdsa
from jaxdsa.cache import StepMeta, init_cache
from jaxdsa.checkpoints.safetensors_io import CheckpointReader
from tests.conftest import FIXTURES


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("name", ["glm5", "glm52"])
def test_mtp_step_follows_the_formula(name):
    llm = jaxdsa.LLM(FIXTURES / name, dtype="float32", page_size=8, progress=False)
    cfg, model = llm.config, llm.model
    assert (
        len(model.mtp) == 1 and model.mtp[0].layer.attn.indexer is not None
    )  # the MTP layer has its own indexer
    ids = np.load(FIXTURES / name / "golden.npz")["prompt_long"].astype(np.int32)
    T, page = len(ids), 8
    pages = -(-T // page)
    meta = StepMeta(
        jnp.zeros(T, jnp.int32), jnp.arange(pages, dtype=jnp.int32)[None], jnp.arange(T, dtype=jnp.int32)
    )
    pos = jnp.arange(T, dtype=jnp.int32)
    main_cache = init_cache(llm.family.cache_spec(cfg), pages, page, jnp.float32)
    h, _ = model(jnp.asarray(ids), pos, main_cache, meta, sparse=True, absorbed=True)
    hidden = model.norm(h[meta.logits_indices])

    # Predict token t+2 at every position t < T-1: main hidden at t, token t+1.
    mtp_cache = lambda: init_cache(llm.family.mtp_cache_spec(cfg), pages, page, jnp.float32)
    n = T - 1
    meta_n = StepMeta(jnp.zeros(n, jnp.int32), meta.page_table, jnp.arange(n, dtype=jnp.int32))
    got, _, _ = model.draft(
        hidden[:n], jnp.asarray(ids[1:]), pos[:n], mtp_cache(), meta_n, sparse=True, absorbed=True
    )

    reader = CheckpointReader(str(FIXTURES / name))
    layer = f"model.layers.{cfg.num_hidden_layers}."
    raw = lambda t: np.asarray(reader.get(t), np.float32)  # noqa: E731
    eps = cfg.rms_norm_eps
    e = _rms(raw("model.embed_tokens.weight")[ids[1:]], raw(layer + "enorm.weight"), eps)
    g = _rms(np.asarray(hidden[:n]), raw(layer + "hnorm.weight"), eps)
    u = np.concatenate([e, g], axis=-1) @ raw(layer + "eh_proj.weight").T
    ctx = model.context(pos[:n], meta_n, sparse=True, absorbed=True)
    u = jnp.asarray(u)
    (h, delta), _, _ = model.mtp[0].layer((u, jnp.zeros_like(u)), ctx, mtp_cache(), (0, 0), None)
    block = h + delta
    want = _rms(np.asarray(block), raw(layer + "shared_head.norm.weight"), eps) @ raw("lm_head.weight").T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    q_a = model.mtp[0].layer.attn.q_a.weight[...]
    np.testing.assert_array_equal(np.asarray(q_a), raw(layer + "self_attn.q_a_proj.weight").T)


def test_checkpoint_without_mtp_weights_loads_without_them():
    llm = jaxdsa.LLM(FIXTURES / "dsv32_yarn", dtype="float32", progress=False)
    assert len(llm.model.mtp) == 0
