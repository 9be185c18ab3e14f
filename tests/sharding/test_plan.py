"""The deployment planner against XLA's own accounting of the sharded decode step."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from checkpoints import walker
from jaxdsa import plan, sharding
from jaxdsa.cache import StepMeta, init_cache
from jaxdsa.engine.runner import ModelState
from jaxdsa.models import family as families
from jaxdsa.models.dsa.family import DsaMode
from jaxdsa.models.registry import family_for, tiny_config


@pytest.mark.parametrize("tp, ep, dp, dp_attention", [(4, 2, 1, False), (2, 2, 2, False), (2, 8, 4, True)])
def test_planner_memory_matches_compiled_step(tp, ep, dp, dp_attention):
    # Widths large enough that weights and cache dominate XLA's per-device arguments.
    cfg = tiny_config(
        "dsv32",
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=128,
        kv_lora_rank=256,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        index_head_dim=64,
        vocab_size=1024,
        n_routed_experts=16,
    )
    family = family_for(cfg.model_type)
    par = sharding.Parallelism(tp=tp, ep=ep, dp=dp, dp_attention=dp_attention)
    mesh = sharding.make_mesh(par)
    model = families.abstract(family, cfg, dtype=jnp.bfloat16, parallelism=par, mtp=0)
    model = families.fill(model, walker.random(family.param_spec(cfg, model), families.targets(model, mesh)))
    pages, page, batch = 64 * dp, 16, 8 * dp
    spec = family.cache_spec(cfg)
    cache = init_cache(
        spec,
        pages,
        page,
        jnp.bfloat16,
        sharding={k: NamedSharding(mesh, sharding.spec(a)) for k, a in spec.axes().items()},
    )
    put = lambda x: sharding.put(x, mesh, sharding.batch_spec())
    zeros = lambda *shape: put(np.zeros(shape, np.int32))
    meta = StepMeta(zeros(batch), zeros(batch, 8), zeros(batch))
    state = ModelState(model)
    fn = sharding.jit_step(
        lambda leaves, *a: family.step(state.model(leaves), *a, DsaMode(sparse=True)),
        mesh,
        donate_argnums=(3,),
        in_axes=(state.axes, None, None, spec.axes()),
        out_axes=(None, spec.axes()),
    )
    compiled = fn.lower(state.leaves, zeros(batch), zeros(batch), cache, meta).compile()
    xla_bytes = compiled.memory_analysis().argument_size_in_bytes

    planned = (
        plan.device_weight_bytes(family, cfg, par, "bf16")
        + plan.cache_bytes_per_token(family, cfg) * pages // dp * page
    )
    assert abs(planned - xla_bytes) / xla_bytes < 0.10, (planned, xla_bytes)


def test_planner_cli_on_a_real_sized_config(tmp_path, capsys):
    import json

    from benchmarks.serve_gpu import GLM5

    (tmp_path / "config.json").write_text(json.dumps(GLM5))

    def run(*flags: str) -> dict[str, float]:
        assert plan.main(["--config", str(tmp_path), "--weights", "int4", "--hbm-gib", "80", *flags]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        return {r[0]: float(r[-1].replace(",", "")) for r in rows if len(r) == 2}

    tp8 = run("--tp", "8", "--ep", "8")
    assert 45 < tp8["weights_gib_per_device"] < 55  # GLM-5 INT4 is about 410 GB over 8 GPUs
    # dp attention on the same 8 GPUs: attention weights are replicated, but each GPU caches only
    # its own group's sequences instead of a copy of everyone's, so the pool grows (2.3x in the
    # default 0.9 budget: the replicated attention weights take part of the 8x).
    dp8 = run("--tp", "1", "--ep", "8", "--dp", "8", "--dp-attention")
    assert dp8["devices"] == 8 and tp8["weights_gib_per_device"] < dp8["weights_gib_per_device"] < 70
    assert dp8["cache_tokens_total"] > 2 * tp8["cache_tokens_total"]
    assert (
        plan.main(["--config", str(tmp_path), "--tp", "3", "--ep", "2"]) == 2
    )  # impossible layout: clear error
    assert (
        plan.main(["--config", str(tmp_path), "--ep", "4", "--dp", "8", "--dp-attention"]) == 2
    )  # ep not a multiple of dp


@pytest.mark.parametrize("name, params_b", [("v4-flash", 284), ("v4-pro", 1600)])
def test_planner_on_released_v4_configs(name, params_b, tmp_path, capsys):
    """V4-Flash / V4-Pro at their released sizes: bf16 weights over 8 GPUs are the published
    parameter counts (284 B / 1.6 T, +- 5 %) at 2 bytes each; dp attention replicates attention."""
    import json

    from jaxdsa.models.deepseek_v4.presets import RELEASED

    (tmp_path / "config.json").write_text(json.dumps(RELEASED[name]))

    def run(*flags: str) -> dict[str, float]:
        assert plan.main(["--config", str(tmp_path), "--hbm-gib", "141", *flags]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        return {r[0]: float(r[-1].replace(",", "")) for r in rows if len(r) == 2}

    tp8 = run("--tp", "8", "--ep", "8")
    total = tp8["weights_gib_per_device"] * 8 * 2**30 / 2  # parameters, if nothing were replicated
    assert abs(total / (params_b * 1e9) - 1) < 0.05, total
    dp8 = run("--tp", "1", "--ep", "8", "--dp", "8", "--dp-attention")
    assert dp8["devices"] == 8 and dp8["weights_gib_per_device"] > tp8["weights_gib_per_device"]
