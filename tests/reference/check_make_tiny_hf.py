#!/usr/bin/env python3
"""Check that Hugging Face transformers reads what ``jaxdsa/checkpoints/make_tiny.py`` writes (not part of
CI).

    <venv>/bin/python tests/reference/check_make_tiny_hf.py [--maker-python .venv/bin/python]

``<venv>``: the reference venv, a Python 3.11 venv with torch==2.13.0 (CPU) transformers==5.23.0
compressed-tensors (README.md here sets it up).

make_tiny runs in the project venv (it imports jaxdsa, hence JAX, which needs Python 3.12); the
checks run here with torch + transformers 5.23. For every tiny preset, float32/bfloat16 and 1/3
shards:

1. ``AutoModelForCausalLM.from_pretrained`` reports no missing or mismatched keys, and no unexpected
   keys except the MTP layer ``model.layers.{num_hidden_layers}.*`` (HF does not implement MTP);
2. every loaded parameter equals the file tensor it came from (HF fuses per-expert weights into
   ``experts.gate_up_proj`` [E, 2I, D] (gate rows first) and ``experts.down_proj`` [E, D, I]);
3. a forward pass on a chat prompt gives finite logits of order 1 and greedy generation runs;
4. ``AutoTokenizer.from_pretrained`` gives a 512-token tokenizer whose special tokens are single ids,
   that round-trips mixed text, and whose ``apply_chat_template`` renders exactly what our renderer,
   the docs/models.md §6.1 / §6.3 examples and (DeepSeek) ``jaxdsa.serve.deepseek_encoding`` produce.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from jaxdsa.checkpoints import tokenizer_assets  # noqa: E402  (tokenizers + jinja2 only)
from jaxdsa.serve import deepseek_encoding  # noqa: E402  (stdlib only)

CASES = [  # (family, preset, dtype, shards)
    ("glm_moe_dsa", "glm5", "float32", 1),
    ("glm_moe_dsa", "glm52", "float32", 3),
    ("glm_moe_dsa", "glm5", "bfloat16", 1),
    ("deepseek_v32", "dsv32", "float32", 3),
    ("deepseek_v32", "dsv32", "bfloat16", 1),
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
GLM_CHATS = [  # (messages, tools, kwargs)
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Again"},
        ],
        None,
        {"enable_thinking": False},
    ),
    (
        [
            {"role": "user", "content": "Weather in Paris? 🙂"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "Need the tool.",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                    }
                ],
            },
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "22°C"},
        ],
        TOOLS,
        {},
    ),
]
DS_CHAT = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
    {"role": "user", "content": "U2"},
]
EXPECTED = {
    "glm": "[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|></think>Hello!"
    "<|user|>Again<|assistant|></think>",
    "chat": "<｜begin▁of▁sentence｜>S<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
    "<｜User｜>U2<｜Assistant｜></think>",
    "thinking": "<｜begin▁of▁sentence｜>S<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
    "<｜User｜>U2<｜Assistant｜><think>",
}
MIXED_TEXT = "Héllo wörld! 你好，世界。こんにちは 🙂🚀👍🏽 def f(x): return x ** 2  # Ångström"


def check(condition: bool, message: str, failures: list[str]) -> None:
    print(("  ok    " if condition else "  FAIL  ") + message)
    if not condition:
        failures.append(message)


def file_tensors(ckpt: pathlib.Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(ckpt.glob("model*.safetensors")):
        tensors |= load_file(file)
    return tensors


def expected_param(name: str, files: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The file value HF should hold in parameter ``name`` (None when nothing explains it)."""
    if name in files:
        return files[name]
    prefix, _, leaf = name.rpartition("experts.")
    experts = sorted(
        {int(k[len(prefix) + 8 :].split(".")[0]) for k in files if k.startswith(prefix + "experts.")}
    )
    if not experts:
        return None
    per = lambda e, proj: files[f"{prefix}experts.{e}.{proj}.weight"]  # noqa: E731
    if leaf == "gate_up_proj":
        return torch.stack([torch.cat([per(e, "gate_proj"), per(e, "up_proj")]) for e in experts])
    if leaf == "down_proj":
        return torch.stack([per(e, "down_proj") for e in experts])
    return None


def check_model(ckpt: pathlib.Path, dtype: str, failures: list[str]) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    model.eval()
    check(not info["missing_keys"], f"no missing keys {sorted(info['missing_keys'])[:5]}", failures)
    check(not info["mismatched_keys"], f"no mismatched keys {sorted(info['mismatched_keys'])[:5]}", failures)
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.startswith(mtp))
    check(
        not unexpected,
        f"unexpected keys only in the MTP layer ({len(info['unexpected_keys'])} there)",
        failures,
    )
    check(not info.get("error_msgs"), f"no load errors {info.get('error_msgs')}", failures)

    files = file_tensors(ckpt)
    state = model.state_dict()
    bad = [
        n
        for n, p in state.items()
        if (e := expected_param(n, files)) is None or not torch.equal(p, e.to(p.dtype))
    ]
    check(not bad, f"all {len(state)} HF parameters equal their file tensors {bad[:5]}", failures)
    generation = json.loads((ckpt / "generation_config.json").read_text())
    check(
        model.generation_config.eos_token_id == generation["eos_token_id"],
        "generation_config eos ids",
        failures,
    )
    want = torch.float32 if dtype == "float32" else torch.bfloat16
    check(model.model.embed_tokens.weight.dtype == want, f"loaded dtype {want}", failures)

    tok = AutoTokenizer.from_pretrained(ckpt)
    if cfg["model_type"] == "glm_moe_dsa":
        prompt = tok.apply_chat_template(GLM_CHATS[0][0], tokenize=False, add_generation_prompt=True)
    else:
        prompt = deepseek_encoding.encode_messages(DS_CHAT)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        logits = model(ids).logits.float()
        out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    std = logits.std().item()
    sane = bool(torch.isfinite(logits).all()) and 0.1 < std < 10
    check(sane, f"forward on {ids.shape[1]} tokens: logits std {std:.3f}", failures)
    check(
        out.shape[1] == ids.shape[1] + 8, f"greedy generate: {tok.decode(out[0, ids.shape[1] :])!r}", failures
    )


def check_tokenizer(ckpt: pathlib.Path, family: str, failures: list[str]) -> None:
    tok = AutoTokenizer.from_pretrained(ckpt)
    spec = tokenizer_assets.family_tokens(family)
    check(len(tok) == tokenizer_assets.VOCAB_SIZE, f"{type(tok).__name__} with {len(tok)} tokens", failures)
    specials = list(spec.leading) + [content for content, _ in spec.added]
    single = {s: tok.encode(s, add_special_tokens=False) for s in specials}
    check(all(len(v) == 1 for v in single.values()), f"special tokens are single ids: {single}", failures)
    check(
        tok.decode(tok.encode(MIXED_TEXT, add_special_tokens=False)) == MIXED_TEXT,
        "mixed text round trip",
        failures,
    )
    plain = tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi", add_special_tokens=False)
    check(plain, "the tokenizer adds no BOS/EOS itself", failures)

    template = tokenizer_assets.chat_template(family)
    if family == "glm_moe_dsa":
        for messages, tools, kwargs in GLM_CHATS:
            for gen in (False, True):
                hf = tok.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs
                )
                ours = tokenizer_assets.render_chat_template(
                    template, messages, tools=tools, add_generation_prompt=gen, **kwargs
                )
                check(
                    hf == ours,
                    f"GLM apply_chat_template == our renderer (tools={bool(tools)}, gen={gen})",
                    failures,
                )
        hf = tok.apply_chat_template(
            GLM_CHATS[0][0], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        check(hf == EXPECTED["glm"], f"docs/models.md §6.1 example: {hf!r}", failures)
    else:
        for mode in ("chat", "thinking"):
            hf = tok.apply_chat_template(
                DS_CHAT, tokenize=False, add_generation_prompt=True, thinking_mode=mode
            )
            check(hf == EXPECTED[mode], f"docs/models.md §6.3 {mode} example: {hf!r}", failures)
            check(
                hf == deepseek_encoding.encode_messages(DS_CHAT, mode),
                f"{mode}: template == encoder",
                failures,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maker-python", default=str(REPO / ".venv" / "bin" / "python"))
    args = parser.parse_args()
    hf_logging.set_verbosity_error()  # the load report lists the MTP keys, which we check ourselves
    hf_logging.disable_progress_bar()
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, preset, dtype, shards in CASES:
            ckpt = pathlib.Path(tmp) / f"{preset}-{dtype}-{shards}"
            cmd = [
                args.maker_python,
                "-m",
                "jaxdsa.checkpoints.make_tiny",
                "--family",
                family,
                "--out",
                str(ckpt),
            ]
            cmd += ["--preset", preset, "--dtype", dtype, "--shards", str(shards), "--seed", "0"]
            subprocess.run(
                cmd, cwd=REPO, check=True, capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
            )
            print(f"{family} {preset} {dtype} shards={shards}")
            check_model(ckpt, dtype, failures)
            check_tokenizer(ckpt, family, failures)
    print(f"\n{len(failures)} failure(s)" if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
