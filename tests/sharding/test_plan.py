"""The deployment planner against XLA's own accounting of the sharded decode step."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxdsa import plan, sharding
from jaxdsa.cache import StepMeta, init_cache
from jaxdsa.checkpoints import walker
from jaxdsa.engine.runner import ModelState
from jaxdsa.models import family as families
from jaxdsa.models.dsa.family import DsaMode
from jaxdsa.models.registry import family_for, released_config, tiny_config

# Left out of the default run (tests/conftest.py; pytest -m slow runs them): two of the three compiled-step
# comparisons: the default run checks dp attention's.
SLOW_CASES = (
    "test_planner_memory_matches_compiled_step[4-2-1-False]",
    "test_planner_memory_matches_compiled_step[2-2-2-False]",
)


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
        # exit status 1 where it does not fit (V4-Pro's 3.2 TB of bf16 on 8 GPUs); the figures print anyway
        args = ["--config", str(tmp_path), "--hbm-gib", "141", "--weights", "bf16", *flags]
        assert plan.main(args) in (0, 1)
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        return {r[0]: float(r[-1].replace(",", "")) for r in rows if len(r) == 2}

    tp8 = run("--tp", "8", "--ep", "8")
    total = tp8["weights_gib_per_device"] * 8 * 2**30 / 2  # parameters, if nothing were replicated
    assert abs(total / (params_b * 1e9) - 1) < 0.05, total
    dp8 = run("--tp", "1", "--ep", "8", "--dp", "8", "--dp-attention")
    assert dp8["devices"] == 8 and dp8["weights_gib_per_device"] > tp8["weights_gib_per_device"]


def test_planner_on_the_released_glm53_flash_config(capsys):
    """GLM-5.3-Flash at its release widths (``--preset glm53-flash``): 45 layers, 34 KDA + 11 DSA. Each
    sequence's KDA states (64 heads x 128 x 128 float32 a layer) and conv rings (3 rows of q, k, v
    channels) split over tp with the KDA heads; the open index pools (16 rows of [kI | z] float32 in
    each full DSA layer) stay whole; the planner counts them per device and prints them."""
    cfg = released_config("glm53-flash")
    assert (cfg.num_hidden_layers, len(cfg.kda_layers), len(cfg.dsa_layers), cfg.hc_mult) == (45, 34, 11, 4)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (288, 8, 1)
    family = family_for(cfg.model_type)
    kda = 34 * 64 * 128 * (128 * 4 + 3 * 3 * 2)
    index_ring = 11 * 16 * 2 * 128 * 4
    for tp in (1, 4, 8):
        par = sharding.Parallelism(tp=tp, ep=tp)
        assert plan.cache_bytes_per_sequence(family, cfg, par=par) == kda // tp + index_ring
    assert plan.cache_bytes_per_token(family, cfg) == 11 * (512 * 2 + 128 * 2 / 16)  # latents, pooled keys

    assert plan.main(["--preset", "glm53-flash", "--tp", "4"]) == 1  # ~600 GB of bf16 over 4 x 80 GB
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("glm53-flash: 45 layers; tp=4 ep=1 dp=1, weights auto (bf16)")
    state = (kda // 4 + index_ring) / 2**20
    assert out[-4].startswith(f"per-sequence state: {state:,.1f} MiB a sequence per device"), out[-4]
    assert out[-3].startswith("does not fit: short by ")
    assert plan.main(["--preset", "glm53-flash", "--tp", "8", "--ep", "8", "--hbm-gib", "140"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"{(kda // 8 + index_ring) / 2**20:,.1f} MiB" in out[-3] and out[-2].startswith("fits: ")
    assert out[-1] == "fewest GPUs: 8 of 140 GiB (-tp 8 -ep 8)"


def test_planner_counts_nvfp4_bytes():
    """GLM-5 with ``--weights nvfp4``: every routed-expert stack is half a byte per weight, an e4m3 byte
    per 16 and a few float32 global scales (one per matrix, repeated over its power-of-two blocks), so
    0.5625 bytes per weight within 0.01 %; its bytes per device sit below INT4's (bf16 scales and
    zero points per 32: 0.594 bytes per weight)."""
    family, cfg, par = family_for("glm_moe_dsa"), released_config("glm5"), sharding.Parallelism(tp=8, ep=8)
    leaves = plan.parameter_leaves(family, cfg, par, "nvfp4")
    experts = [leaf for leaf in leaves if leaf.path[-1] in ("gate_up", "down")]
    by_path: dict[tuple, list[plan.Leaf]] = {}
    for leaf in experts:
        by_path.setdefault(leaf.path, []).append(leaf)
    assert by_path and all(len(parts) == 3 for parts in by_path.values())  # codes, scales, global scales
    for parts in by_path.values():
        codes, scales, global_scales = parts
        weights = np.prod(codes.shape) * 2  # two e2m1 codes per byte
        nbytes = sum(np.prod(p.shape) * p.width for p in parts)
        assert (codes.width, scales.width, global_scales.width) == (1, 1, 4)
        assert abs(nbytes / weights / 0.5625 - 1) < 1e-4
    bytes_nvfp4 = plan.device_weight_bytes(family, cfg, par, "nvfp4", leaves)
    assert bytes_nvfp4 < plan.device_weight_bytes(family, cfg, par, "int4")


# The README's what-fits table: each row's checkpoint as the planner's preset and --weights.
README_ROWS = {
    "GLM-5.2 / 5.1 INT4": ("glm52", "int4"),
    "GLM-5.2 / 5.1 FP8": ("glm52", "fp8"),
    "GLM-5.x BF16": ("glm52", "bf16"),
    "DeepSeek-V3.2 (FP8)": ("dsv32", "auto"),
    "DeepSeek-V4-Flash": ("v4-flash", "auto"),
    "DeepSeek-V4-Pro": ("v4-pro", "auto"),
}
TP8 = sharding.Parallelism(tp=8, ep=8)
DP8 = sharding.Parallelism(tp=1, ep=8, dp=8, dp_attention=True)


def _tokens(n: int) -> str:
    """Cache tokens as the README writes them: 161k, 5.3M, 118M."""
    return f"{n / 1e6:.0f}M" if n >= 1e8 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _readme_rows() -> dict[str, list[str]]:
    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        label = next((k for k in README_ROWS if line.startswith(f"| {k}")), None)
        if label:
            rows[label] = [c.strip() for c in line.split("|")[1:-1]]
    return rows


def _planned(
    preset: str, weights: str, par, hbm: float, utilization: float = 0.9, kv_format: str = "model"
) -> dict[str, float]:
    cfg = released_config(preset)
    return plan.plan(
        family_for(cfg.model_type), cfg, par, hbm_gib=hbm, weights=weights, max_model_len=32768, batch=32,
        hbm_gbs=3000, link_gbs=350, gpu_memory_utilization=utilization, kv_format=kv_format,
    )  # fmt: skip


def test_the_readme_what_fits_table_is_the_planners():
    rows = _readme_rows()
    assert set(rows) == set(README_ROWS), "a README row the test does not know, or one missing"
    for label, (preset, weights) in README_ROWS.items():
        _, stored, gpus80, gpus141 = rows[label]
        sizes = [float(x) for x in re.findall(r"[\d.]+", stored)]
        want = [_planned(preset, weights, par, 79)["weights_gib_per_device"] for par in (TP8, DP8)]
        assert sizes == pytest.approx(want[: len(sizes)], abs=0.06), (label, sizes, want)
        for hbm, cell in ((79, gpus80), (140, gpus141)):
            tp8, dp8 = _planned(preset, weights, TP8, hbm), _planned(preset, weights, DP8, hbm)
            if not plan.fits(tp8, 32768):
                assert cell == "does not fit", (label, hbm, cell)
                continue
            assert cell.startswith(f"fits: {_tokens(tp8['cache_tokens_total'])}"), (label, hbm, cell)
            dp_utilization = 0.95 if "at `--gpu-memory-utilization 0.95`" in cell else 0.9
            dp8 = _planned(preset, weights, DP8, hbm, dp_utilization)
            if plan.fits(dp8, 32768):
                assert _tokens(dp8["cache_tokens_total"]) in cell, (label, hbm, cell)
            # every cell adds the fp8 cache's tokens
            fp8 = [
                _tokens(_planned(preset, weights, par, hbm, u, kv_format="fp8")["cache_tokens_total"])
                for par, u in ((TP8, 0.9), (DP8, dp_utilization))
            ]
            assert cell.endswith(f"; fp8: {fp8[0]} ({fp8[1]})"), (label, hbm, cell)


def test_glm5_fits_where_the_readme_says_glm52_does():
    """The README's GLM-5.x rows are GLM-5.2's; GLM-5 (the first release, every layer with a full
    indexer) weighs within 0.5 % and gets the same verdicts on both GPU sizes, in each format."""
    rows = _readme_rows()
    for label, (preset, weights) in README_ROWS.items():
        if preset != "glm52":
            continue
        _, stored, gpus80, gpus141 = rows[label]
        for hbm, cell in ((79, gpus80), (140, gpus141)):
            glm5, glm52 = _planned("glm5", weights, TP8, hbm), _planned("glm52", weights, TP8, hbm)
            assert plan.fits(glm5, 32768) == (cell != "does not fit") == plan.fits(glm52, 32768), (label, hbm)
            ratio = glm5["weights_gib_per_device"] / glm52["weights_gib_per_device"]
            assert abs(ratio - 1) < 0.005, (label, ratio)


def test_the_planners_verdict_and_the_fewest_gpus(capsys):
    int4 = ["--preset", "glm52", "--weights", "int4"]
    assert plan.main([*int4, "--tp", "8", "--ep", "8", "--hbm-gib", "79"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("glm52: 78 layers; tp=8 ep=8 dp=1, weights int4, kv cache bf16, 79 GiB GPUs")
    assert out[-2] == "fits: 159,253 cache tokens (4 sequences of 32,768 per dp group)"
    assert out[-1] == "fewest GPUs: 8 of 79 GiB (-tp 8 -ep 8)"
    # the FP8 cache: 656-byte latent rows in 78 layers, 132-byte index keys in GLM-5.2's 21 full layers
    assert plan.main([*int4, "--tp", "8", "--ep", "8", "--hbm-gib", "79", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert ", kv cache fp8, " in out[0]
    per_token = {line.split()[0]: line.split()[1] for line in out[1:] if line.startswith("  ")}
    assert per_token["cache_bytes_per_token"] == f"{78 * 656 + 21 * 132:,}.00"
    # the same budget over the fp8 bytes (each count rounded down from the budget, not from the other)
    tokens = 159_253 * (78 * 1152 + 21 * 256) / (78 * 656 + 21 * 132)
    head, _, rest = out[-2].partition(" cache tokens ")
    assert head.startswith("fits: ") and abs(int(head[6:].replace(",", "")) - tokens) < 3, out[-2]
    assert rest == "(8 sequences of 32,768 per dp group)"
    assert plan.main(["--preset", "glm52", "--tp", "4", "--ep", "4", "--hbm-gib", "79"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "weights auto (bf16)" in out[0]  # GLM's released config: BF16
    assert out[-3].startswith("does not fit: short by ") and "GiB per GPU" in out[-3]
    assert out[-2].startswith("with routed experts in host RAM: fits with --num-gpu-experts ")
    assert out[-1].startswith("fewest GPUs: 32 of 79 GiB (-tp 32 -ep 32); more than one host of 8")
    assert plan.main(["--preset", "v4-flash", "--hbm-gib", "140"]) == 1  # one GPU: short
    out = capsys.readouterr().out.splitlines()
    assert (
        "weights auto (fp8, fp4 experts)" in out[0] and out[-1] == "fewest GPUs: 2 of 140 GiB (-tp 2 -ep 2)"
    )
    with pytest.raises(SystemExit):
        plan.main(["--preset", "v4-flash", "--max-model-len", "0"])
    assert "--max-model-len must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("fixture, gpu", [("glm5_int4", 4), ("dsv32_fp8", 0), ("glm5_nvfp4", 2)])
def test_planner_host_split_matches_the_loader(fixture, gpu):
    """--num-gpu-experts: the planner's routed-expert bytes on the GPU and in host RAM are what the
    loader holds (INT4 experts half on the host; FP8 experts all there, with the float32 copy of
    their block scales the CPU kernel reads; NVFP4 experts with their float32 effective scales)."""
    import jax
    from flax import nnx

    import jaxdsa
    from jaxdsa.layers.mlp import Experts
    from jaxdsa.offload import cpu_moe
    from tests.conftest import FIXTURES

    llm = jaxdsa.LLM(FIXTURES / fixture, dtype="bfloat16", progress=False, num_gpu_experts=gpu)
    nodes = [node for _, node in nnx.iter_graph(llm.model) if isinstance(node, Experts)]

    def nbytes(tree):
        return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))

    loaded_gpu = sum(nbytes(node.gate_up.get_value()) + nbytes(node.down.get_value()) for node in nodes)
    host_weights = [w for node in nodes for layer in node.host._layers for w in layer]
    nvfp4 = lambda w: w.fmt == cpu_moe.FP4 and w.scale_kind == cpu_moe.SCALE_F32  # noqa: E731
    widened = sum(w.scales.nbytes for w in host_weights if w.fmt == cpu_moe.FP8 or nvfp4(w))
    loaded_host = sum(nbytes(node.host.experts) for node in nodes) + widened

    family, par = family_for(llm.config.model_type), sharding.Parallelism()
    leaves = [leaf for leaf in plan.parameter_leaves(family, llm.config, par, "auto") if leaf.experts]
    assert plan.device_weight_bytes(family, llm.config, par, "auto", leaves, gpu) == loaded_gpu
    assert plan.host_expert_bytes(leaves, gpu) == loaded_host


def test_planner_says_how_many_experts_fit_on_the_gpus(capsys):
    """GLM-5.2 INT4 does not fit 4 x 80 GB whole; the planner finds the most routed experts per
    layer that do (a multiple of the 4 expert shards: one more shard's worth does not fit) and
    sizes the host side; an expert count the mesh cannot split is refused."""
    cfg, par = released_config("glm52"), sharding.Parallelism(tp=4, ep=4)
    family = family_for(cfg.model_type)
    sizes = dict(hbm_gib=80, weights="int4", batch=1, max_model_len=8192)
    n, total = plan.gpu_experts_that_fit(family, cfg, par, **sizes)
    assert total == 256 and 0 < n < total and n % 4 == 0
    for experts, fit in ((n, True), (n + 4, False)):
        assert plan.fits(plan.memory_plan(family, cfg, par, num_gpu_experts=experts, **sizes), 8192) == fit
    whole = plan.memory_plan(family, cfg, par, **sizes)
    split = plan.memory_plan(family, cfg, par, num_gpu_experts=n, **sizes)
    assert whole["host_experts_gib"] == 0 and split["host_experts_gib"] > 100
    assert split["weights_gib_per_device"] < whole["weights_gib_per_device"]
    with pytest.raises(ValueError, match="multiple of 4"):
        plan.memory_plan(family, cfg, par, num_gpu_experts=n + 2, **sizes)

    argv = ["--preset", "glm52", "--tp", "4", "--ep", "4", "--weights", "int4", "--max-model-len", "8192"]
    assert plan.main(argv) == 1
    assert f"fits with --num-gpu-experts {n} of 256 per MoE layer" in capsys.readouterr().out
    assert plan.main([*argv, "--num-gpu-experts", str(n), "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host_experts_gib\s+[1-9]", out)
    assert re.search(r"decode_host_bytes_read_gib\s+[1-9]", out)
