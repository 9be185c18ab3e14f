"""The committed GLM-5.3-Flash goldens (tests/fixtures/glm53*, made by
tests/reference/make_goldens_glm5_next.py) have the structure the parity tests rely on.

Structure only, with numpy and safetensors headers: golden.npz's keys, shapes and dtypes against the
config jaxdsa parses; the prompts reach the regions they are meant to (dense, sparse inside one KDA
chunk, across chunk boundaries); the tensor names, shapes and storage dtypes of docs/models.md §9.8,
equal in both layouts; the sharded index names every tensor. No model runs here.
"""

import json

import numpy as np
import pytest
from safetensors import safe_open

from jaxdsa.models.glm5_next.config import KDA_CHUNK, load_glm5_next_config
from tests.conftest import FIXTURES

NAMES = ["glm53", "glm53_sharded"]
T = "model.language_model."
NEW_TOKENS = 16
# What HF keeps in float32 (stored so); everything else is bfloat16.
FP32_SUFFIXES = ("e_score_correction_bias", "_conv1d.weight", "dt_bias", "A_log") + tuple(
    f"hc_{site}_{x}" for site in ("attn", "ffn") for x in ("base", "scale")
)


def headers(directory) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """name -> (shape, dtype, file) over every safetensors file of the directory."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "numpy") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype(), file.name)
    return out


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The text model's tensors (docs/models.md §9.8) for a parsed config."""
    d, hk, k = cfg.hidden_size, cfg.linear_dim, cfg.linear_head_dim
    hc = (2 + cfg.hc_mult) * cfg.hc_mult
    heads, q_lora, kv_lora = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    n_i, d_i = cfg.index_n_heads, cfg.index_head_dim
    out = {
        f"{T}embed_tokens.weight": (cfg.vocab_size, d),
        f"{T}norm.weight": (d,),
        "lm_head.weight": (cfg.vocab_size, d),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"{T}layers.{i}."
        layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
        for site in ("attn", "ffn"):
            layer |= {
                f"hc_{site}_fn": (hc, cfg.hc_mult * d),
                f"hc_{site}_base": (hc,),
                f"hc_{site}_scale": (3,),
            }
        a = "self_attn."
        if i in cfg.kda_layers:
            layer |= {f"{a}{x}_proj.weight": (hk, d) for x in "qkv"}
            layer |= {f"{a}{x}_conv1d.weight": (hk, 1, cfg.linear_conv_kernel_dim) for x in "qkv"}
            layer |= {
                f"{a}f_a_proj.weight": (k, d),
                f"{a}f_b_proj.weight": (hk, k),
                f"{a}dt_bias": (hk,),
                f"{a}A_log": (cfg.linear_num_heads,),
                f"{a}b_proj.weight": (cfg.linear_num_heads, d),
                f"{a}g_a_proj.weight": (k, d),
                f"{a}g_b_proj.weight": (hk, k),
                f"{a}o_norm.weight": (k,),
                f"{a}o_proj.weight": (d, hk),
            }
        else:
            layer |= {
                f"{a}q_a_proj.weight": (q_lora, d),
                f"{a}q_a_layernorm.weight": (q_lora,),
                f"{a}q_b_proj.weight": (heads * cfg.qk_head_dim, q_lora),
                f"{a}kv_a_proj_with_mqa.weight": (kv_lora, d),
                f"{a}kv_a_layernorm.weight": (kv_lora,),
                f"{a}kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv_lora),
                f"{a}o_proj.weight": (d, heads * cfg.v_head_dim),
            }
            if cfg.has_indexer(i):
                a += "indexer."
                layer |= {
                    f"{a}wq_b.weight": (n_i * d_i, q_lora),
                    f"{a}wk.weight": (d_i, d),
                    f"{a}k_norm.weight": (d_i,),
                    f"{a}k_norm.bias": (d_i,),
                    f"{a}weights_proj.weight": (n_i, d),
                    f"{a}index_kpool_compress_ape": (cfg.index_kpool, d_i),
                    f"{a}index_kpool_compress_gate": (d_i, d),
                }
        if cfg.is_moe_layer(i):
            inter = cfg.moe_intermediate_size
            layer |= {"mlp.gate.weight": (cfg.n_routed_experts, d)}
            layer |= {"mlp.gate.e_score_correction_bias": (cfg.n_routed_experts,)}
            for e in [f"experts.{e}" for e in range(cfg.n_routed_experts)] + ["shared_experts"]:
                width = inter * (cfg.n_shared_experts if e == "shared_experts" else 1)
                layer |= {f"mlp.{e}.{x}_proj.weight": (width, d) for x in ("gate", "up")}
                layer |= {f"mlp.{e}.down_proj.weight": (d, width)}
        else:
            layer |= {f"mlp.{x}_proj.weight": (cfg.intermediate_size, d) for x in ("gate", "up")}
            layer |= {"mlp.down_proj.weight": (d, cfg.intermediate_size)}
        out |= {p + name: shape for name, shape in layer.items()}
    return out


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    directory = FIXTURES / request.param
    return directory, load_glm5_next_config(directory), dict(np.load(directory / "golden.npz"))


def test_config_release_spellings_mean_the_hf_form():
    hf, release = (load_glm5_next_config(FIXTURES / name) for name in NAMES)
    assert hf == release
    raw = json.loads((FIXTURES / "glm53_sharded" / "config.json").read_text())["text_config"]
    assert "deepseek_sparse_attention" in raw["layer_types"] and "linear_num_heads" not in raw
    assert raw["linear_attn_config"]["kda_layers"] == list(hf.kda_layers)
    assert raw["first_k_dense_replace"] == 2
    assert hf.kda_layers == (0, 3, 4, 6) and hf.dsa_layers == (1, 2, 5, 7) and not hf.has_indexer(2)


def test_golden_keys_and_shapes(fixture):
    _, cfg, g = fixture
    v, width = cfg.vocab_size, cfg.index_width
    for key in ("prompt_short", "prompt_mid", "prompt_long", "greedy_prompt"):
        assert g[key].dtype == np.int32 and g[key].ndim == 1 and 0 <= g[key].min() and g[key].max() < v
    for key in ("short", "mid", "long"):
        assert g[f"logits_{key}"].dtype == np.float32
        assert g[f"logits_{key}"].shape == (len(g[f"prompt_{key}"]), v)
    assert g["greedy_tokens"].dtype == np.int32 and g["greedy_tokens"].shape == (NEW_TOKENS,)
    assert g["greedy_logits"].dtype == np.float32 and g["greedy_logits"].shape == (NEW_TOKENS, v)
    assert (g["greedy_logits"].argmax(-1) == g["greedy_tokens"]).all()
    t_mid = len(g["prompt_mid"])
    for i in range(cfg.num_hidden_layers):
        assert g[f"layer_out_{i}"].dtype == np.float32
        assert g[f"layer_out_{i}"].shape == (t_mid, cfg.hc_mult, cfg.hidden_size)
    assert sorted(k for k in g if k.startswith("topk_")) == [f"topk_{i}" for i in cfg.dsa_layers]
    for i in cfg.dsa_layers:
        lists = g[f"topk_{i}"]
        assert lists.dtype == np.int32 and lists.shape == (t_mid, width)
        for p, row in enumerate(lists):
            valid = row[row >= 0]
            assert (row >= -1).all() and (valid <= p).all() and len(set(valid)) == len(valid)
            assert set(range(p + 1 - (p + 1) % cfg.index_kpool, p + 1)) <= set(valid)  # the open pool
    assert (g["topk_2"] == g["topk_1"]).all()  # the shared layer attends layer 1's lists
    for key in ("greedy_min_margin", "indexer_min_rel_gap", "fp64_rel", "cache_vs_recompute_rel"):
        assert g[key].dtype == np.float64 and g[key].shape == ()
    assert g["greedy_min_margin"] >= 1e-2 and g["indexer_min_rel_gap"] >= 1e-4
    assert str(g["hf_version"]) == "5.23.0" and g["seed"].dtype == np.int64


def test_prompts_reach_their_regions(fixture):
    """short dense, mid sparse inside one KDA chunk, long across two chunk boundaries and inside a pool."""
    _, cfg, g = fixture
    sparse_from = (cfg.index_pools + 1) * cfg.index_kpool
    assert len(g["prompt_short"]) < sparse_from < len(g["prompt_mid"]) <= KDA_CHUNK
    assert len(g["prompt_long"]) > 2 * KDA_CHUNK and len(g["prompt_long"]) % cfg.index_kpool
    assert len(g["greedy_prompt"]) > KDA_CHUNK
    assert len(g["prompt_long"]) <= cfg.max_position_embeddings


def test_checkpoint_names_shapes_and_dtypes(fixture):
    directory, cfg, _ = fixture
    files = headers(directory)
    text = {n: f for n, f in files.items() if not n.startswith("model.visual.")}
    assert {n: f[0] for n, f in text.items()} == expected_shapes(cfg)
    assert len(files) > len(text)  # the vision tower is there too
    for name, (_, dtype, _) in files.items():
        assert dtype == ("F32" if name.endswith(FP32_SUFFIXES) else "BF16"), name


def test_sharded_index_names_every_tensor():
    directory = FIXTURES / "glm53_sharded"
    files = headers(directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {name: file for name, (_, _, file) in files.items()}
    assert len(set(index["weight_map"].values())) == 4
    sizes = {"F32": 4, "BF16": 2}
    assert index["metadata"]["total_size"] == sum(np.prod(s) * sizes[d] for s, d, _ in files.values())
    single = headers(FIXTURES / "glm53")
    assert {n: f[:2] for n, f in files.items()} == {n: f[:2] for n, f in single.items()}
