#!/usr/bin/env python3
"""Check that Hugging Face transformers reads the tiny GLM-5.3-Flash that ``make_tiny`` writes, and
reads config.json files as jaxdsa's parser does (not part of CI).

    <venv>/bin/python tests/reference/check_make_tiny_hf_glm5_next.py [--maker-python .venv/bin/python]

``<venv>``: the reference venv of README.md here (Python 3.11, torch 2.13.0, transformers 5.23.0).
make_tiny and jaxdsa's config parser run in the project venv (``--maker-python``); nothing of the
``jaxdsa`` package is imported here (its ``__init__`` needs JAX): the presets and the tokenizer
assets are read by file path. For the ``glm53`` preset in float32 (one file) and bfloat16 (three
shards):

1. ``Glm5NextForConditionalGeneration.from_pretrained`` reports no missing, unexpected or
   mismatched keys and no load errors;
2. every HF parameter equals the file tensor(s) it came from through HF's conversion mapping
   (``self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}`` -> ``self_attn.forget_gate.*``,
   ``hc_{attn,ffn}_*`` -> ``{attn,ffn}_hc.*``, ``{q,k,v}_conv1d`` concatenated into ``conv1d``,
   per-expert weights stacked), and every file tensor is used;
3. every parameter HF initializes to a constant (norms, biases, HC base / scale, ``A_log``, the
   router bias, the pool ``ape`` and gate) is not constant in the file; HF's float32 modules are
   float32 after a bfloat16 load;
4. forwards on a chat prompt and on 80 tokens (two KDA chunks of 64, twenty key pools of 4) give
   finite logits of order 1, and greedy generation with the cache picks the argmax of an uncached
   forward over the same tokens;
5. the vision tower turns a 4 x 4-patch image into 4 finite rows of the text width;
6. the tokenizer has 512 tokens, single-id special tokens and the GLM chat template;
7. jaxdsa's ``parse_config`` gives HF's ``Glm5NextTextConfig`` values for the preset and for
   release-shaped files (HF's defaults, the ``linear_attn_config`` / ``deepseek_sparse_attention``
   spellings, a flat file, ``index_topk_freq``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.utils import logging as hf_logging

REPO = pathlib.Path(__file__).resolve().parents[2]
CASES = [("glm53", "float32", 1), ("glm53", "bfloat16", 3)]  # (preset, dtype, shards)
TEXT = "model.language_model."
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Again"},
]
# HF's renames (conversion_mapping.py, "glm5_next"), module name -> file name.
RENAMES = [(f".self_attn.forget_gate.{x}", f".self_attn.{x}") for x in ("f_a_proj.", "f_b_proj.")]
RENAMES += [(f".self_attn.forget_gate.{x}", f".self_attn.{x}") for x in ("dt_bias", "A_log")]
RENAMES += [
    (f".{site}_hc.{x}", f".hc_{site}_{x}") for site in ("attn", "ffn") for x in ("fn", "base", "scale")
]


def load_by_path(name: str, relative: str):
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


presets = load_by_path("presets", "jaxdsa/checkpoints/tiny/presets.py")
tokenizer_assets = load_by_path("tokenizer_assets", "jaxdsa/checkpoints/tokenizer_assets.py")


def check(condition: bool, message: str, failures: list[str]) -> None:
    print(("  ok    " if condition else "  FAIL  ") + message)
    if not condition:
        failures.append(message)


def file_tensors(ckpt: pathlib.Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(ckpt.glob("model*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    return tensors


def sources(name: str, files: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor | None]:
    """The file tensors HF parameter ``name`` is made of, and the value they make (None: unexplained)."""
    for module_name, file_name in RENAMES:
        name = name.replace(module_name, file_name)
    if name in files:
        return [name], files[name]
    if name.endswith(".self_attn.conv1d.weight"):
        used = [name.replace("conv1d", f"{x}_conv1d") for x in "qkv"]
        return used, torch.cat([files[n] for n in used]) if all(n in files for n in used) else None
    prefix, _, leaf = name.rpartition("experts.")
    count = len({k.split(".")[len(prefix.split("."))] for k in files if k.startswith(prefix + "experts.")})
    projections = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    if not count or leaf not in projections:
        return [], None
    used = [f"{prefix}experts.{e}.{p}.weight" for e in range(count) for p in projections[leaf]]
    per = [
        torch.cat([files[f"{prefix}experts.{e}.{p}.weight"] for p in projections[leaf]]) for e in range(count)
    ]
    return used, torch.stack(per)


def check_weights(model, ckpt: pathlib.Path, dtype: str, failures: list[str]) -> None:
    files = file_tensors(ckpt)
    used, bad = set(), []
    for name, param in model.state_dict().items():
        names, value = sources(name, files)
        used |= set(names)
        if value is None or value.shape != param.shape or not torch.equal(param, value.to(param.dtype)):
            bad.append(name)
    check(
        not bad, f"all {len(model.state_dict())} HF parameters equal their file tensors {bad[:5]}", failures
    )
    check(
        used == set(files),
        f"every one of the {len(files)} file tensors is used {sorted(set(files) - used)[:5]}",
        failures,
    )

    torch.manual_seed(0)
    fresh = Glm5NextForConditionalGeneration(model.config).state_dict()
    constant = [n for n, p in fresh.items() if p.numel() > 1 and bool((p == p.flatten()[0]).all())]
    still = [n for n in constant if bool((model.state_dict()[n] == model.state_dict()[n].flatten()[0]).all())]
    check(
        not still,
        f"the {len(constant)} parameters HF initializes to a constant are random here {still[:5]}",
        failures,
    )

    want = torch.float32 if dtype == "float32" else torch.bfloat16
    check(model.model.language_model.embed_tokens.weight.dtype == want, f"loaded dtype {want}", failures)
    if dtype != "float32":  # HF's float32 modules: stored float32 too
        kept = [n for n, p in model.state_dict().items() if p.dtype == torch.float32]
        stored = all(files[sources(n, files)[0][0]].dtype == torch.float32 for n in kept)
        check(stored, f"the {len(kept)} float32 parameters are float32 in the file", failures)


def check_forward(model, ckpt: pathlib.Path, failures: list[str]) -> None:
    tok = AutoTokenizer.from_pretrained(ckpt)
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    chat = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    long = torch.randint(0, len(tok), (1, 80), generator=torch.Generator().manual_seed(0))
    for ids in (chat, long):
        with torch.no_grad():
            logits = model(ids).logits.float()
        std = logits.std().item()
        sane = bool(torch.isfinite(logits).all()) and 0.1 < std < 10
        check(sane, f"forward on {ids.shape[1]} tokens: logits std {std:.3f}", failures)
    with torch.no_grad():
        mask = torch.ones_like(chat)  # else generate masks any prompt token equal to pad_token_id
        out = model.generate(
            chat, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        again = model(out).logits[0, chat.shape[1] - 1 : -1].argmax(-1)
    new = out[0, chat.shape[1] :]
    check(
        bool((again == new).all()),
        f"cached greedy generation {tok.decode(new)!r} = uncached argmax",
        failures,
    )


def check_vision(model, failures: list[str]) -> None:
    vision = model.config.vision_config
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, patch, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rows = model.model.get_image_features(pixels, grid).pooler_output[0].float()
    width = model.config.text_config.hidden_size
    check(
        rows.shape == (4, width) and bool(torch.isfinite(rows).all()),
        f"vision tower: 16 patches -> {tuple(rows.shape)} rows",
        failures,
    )


def check_tokenizer(ckpt: pathlib.Path, failures: list[str]) -> None:
    tok = AutoTokenizer.from_pretrained(ckpt)
    spec = tokenizer_assets.family_tokens("glm_moe_dsa")
    check(len(tok) == tokenizer_assets.VOCAB_SIZE, f"{type(tok).__name__} with {len(tok)} tokens", failures)
    single = all(len(tok.encode(s, add_special_tokens=False)) == 1 for s, _ in spec.added)
    check(single, "special tokens are single ids", failures)
    hf = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    ours = tokenizer_assets.render_chat_template(
        tokenizer_assets.chat_template("glm_moe_dsa"), CHAT, add_generation_prompt=True, enable_thinking=False
    )
    check(hf == ours, f"apply_chat_template == our renderer: {hf!r}", failures)


def check_model(ckpt: pathlib.Path, dtype: str, failures: list[str]) -> None:
    model, info = Glm5NextForConditionalGeneration.from_pretrained(ckpt, output_loading_info=True)
    model.eval()
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        check(not info.get(key), f"no {key.replace('_', ' ')} {sorted(info.get(key) or [])[:5]}", failures)
    check_weights(model, ckpt, dtype, failures)
    check_forward(model, ckpt, failures)
    check_vision(model, failures)
    check_tokenizer(ckpt, failures)


# ---------------------------------------------------------------------------------------------
# config.json: jaxdsa's parser against HF's Glm5NextConfig


def release_shaped() -> dict[str, dict]:
    """config.json dicts as releases may spell them: 45 layers, 288 experts top-8 + 1 shared, hc 4."""
    base = {"num_hidden_layers": 45, "n_routed_experts": 288, "num_experts_per_tok": 8, "n_shared_experts": 1}
    schedule = ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(45)]
    release = base | {
        "layer_types": schedule,
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42,
        "first_k_dense_replace": 3,
        "num_nextn_predict_layers": 1,
        "index_kpool": 4,
        "linear_attn_config": {
            "num_heads": 64,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "kda_layers": [i for i in range(45) if i % 4 != 3],
            "full_attn_layers": [i for i in range(45) if i % 4 == 3],
        },
    }
    top = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next"}
    return {
        "hf defaults": top | {"text_config": base | {"hc_mult": 4}},
        "release keys": top | {"text_config": release},
        "flat": top | base | {"linear_lower_bound": None, "index_topk_freq": 2},
        "pattern": top | {"text_config": base | {"index_topk_pattern": "F" * 40 + "FS" + "F" * 3}},
    }


FIELDS = (
    "vocab_size hidden_size num_hidden_layers layer_types indexer_types mlp_layer_types linear_num_heads "
    "linear_head_dim linear_conv_kernel_dim linear_lower_bound num_attention_heads q_lora_rank kv_lora_rank "
    "qk_nope_head_dim qk_rope_head_dim v_head_dim index_n_heads index_head_dim index_topk index_kpool "
    "index_kpool_always_select_tail hc_mult hc_eps hc_sinkhorn_iters intermediate_size moe_intermediate_size "
    "n_routed_experts n_shared_experts num_experts_per_tok n_group topk_group routed_scaling_factor "
    "norm_topk_prob swiglu_limit rms_norm_eps max_position_embeddings pad_token_id"
).split()

PARSE = """
import dataclasses, json, sys
from jaxdsa.models.glm5_next.config import parse_config
out = {}
for name, raw in json.load(sys.stdin).items():
    cfg = parse_config(raw, name)
    out[name] = {f: getattr(cfg, f) for f in sys.argv[1:]}
print(json.dumps(out))
"""


def check_configs(maker_python: str, failures: list[str]) -> None:
    configs = {"glm53 preset": presets.GLM5_NEXT_TINY_PRESETS["glm53"]} | release_shaped()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    ours = subprocess.run(
        [maker_python, "-c", PARSE, *FIELDS],
        input=json.dumps(configs),
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    parsed = json.loads(ours.stdout)
    for name, raw in configs.items():
        text = Glm5NextConfig(**raw).text_config
        hf = {f: getattr(text, f) for f in FIELDS}
        hf["layer_types"] = list(text.layer_types)
        differ = {f: (parsed[name][f], hf[f]) for f in FIELDS if parsed[name][f] != hf[f]}
        kinds = "".join("D" if t == "indexed_attention" else "K" for t in hf["layer_types"])
        check(
            not differ, f"config {name!r}: jaxdsa = HF on {len(FIELDS)} fields ({kinds}) {differ}", failures
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maker-python", default=str(REPO / ".venv" / "bin" / "python"))
    args = parser.parse_args()
    hf_logging.set_verbosity_error()  # the reference-kernel fallback notices
    hf_logging.disable_progress_bar()
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset, dtype, shards in CASES:
            ckpt = pathlib.Path(tmp) / f"{preset}-{dtype}-{shards}"
            cmd = [args.maker_python, "-m", "jaxdsa.checkpoints.make_tiny", "--family", "glm5_next"]
            cmd += ["--out", str(ckpt), "--preset", preset, "--dtype", dtype, "--shards", str(shards)]
            env = {**os.environ, "JAX_PLATFORMS": "cpu"}
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env=env)
            print(f"glm5_next {preset} {dtype} shards={shards}")
            check_model(ckpt, dtype, failures)
    print("config.json parsing")
    check_configs(args.maker_python, failures)
    print(f"\n{len(failures)} failure(s)" if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
