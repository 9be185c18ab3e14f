"""Chat rendering as transformers does it: the checkpoint's Jinja template, or DeepSeek's encoder."""

from __future__ import annotations

import os

import pytest

from jaxdsa.checkpoints import tokenizer_assets
from jaxdsa.serve.chat_format import ChatTemplateError, DeepSeekChatFormat, JinjaChatFormat, load_chat_format
from jaxdsa.serve.deepseek_encoding import encode_messages
from jaxdsa.serve.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def glm_format(model_dir: str) -> JinjaChatFormat:
    tok = Tokenizer(model_dir)
    fmt = load_chat_format(model_dir, "glm_moe_dsa", tok.config, tok.special_tokens_map)
    assert isinstance(fmt, JinjaChatFormat)
    return fmt


def test_glm_template_from_the_checkpoint(glm_dir):
    fmt = glm_format(glm_dir)
    on = fmt.render(MESSAGES)
    assert on.text == "[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|><think>" and on.thinking
    off = fmt.render(MESSAGES, kwargs={"enable_thinking": False})
    assert off.text.endswith("<|assistant|></think>") and not off.thinking
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    expected = tokenizer_assets.render_chat_template(
        tokenizer_assets.GLM_CHAT_TEMPLATE, MESSAGES, tools=tools, add_generation_prompt=True
    )
    assert fmt.render(MESSAGES, tools).text == expected


def test_template_sees_special_tokens_kwargs_and_hf_helpers():
    template = (
        "{% generation %}{{ bos_token }}{% endgeneration %}{{ messages[0].content | tojson }}"
        "{{ '!' if add_generation_prompt }}{{ custom }}{% if strftime_now('%Y') | int < 2000 %}x{% endif %}"
    )
    fmt = JinjaChatFormat(template, {"bos_token": "<s>"})
    assert fmt.render([{"role": "user", "content": "é"}], kwargs={"custom": "K"}).text == '<s>"é"!K'


def test_raise_exception_becomes_a_chat_template_error(glm_dir):
    with pytest.raises(ChatTemplateError, match="unknown role"):
        glm_format(glm_dir).render([{"role": "narrator", "content": "x"}])


def test_template_file_and_missing_template(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    fmt = load_chat_format(str(tmp_path), "glm_moe_dsa", {}, {})
    assert fmt.render([{"role": "user", "content": "hi"}]).text == "hi"
    os.remove(tmp_path / "chat_template.jinja")
    assert load_chat_format(str(tmp_path), "glm_moe_dsa", {}, {}) is None


def test_deepseek_uses_the_encoder_with_thinking_kwargs():
    fmt = DeepSeekChatFormat()
    chat = fmt.render(MESSAGES)
    assert chat.text == encode_messages(MESSAGES, "chat") and not chat.thinking
    for kwargs in ({"thinking": True}, {"enable_thinking": True}, {"thinking_mode": "thinking"}):
        p = fmt.render(MESSAGES, kwargs=kwargs)
        assert p.text == encode_messages(MESSAGES, "thinking") and p.thinking
    with pytest.raises(ChatTemplateError):
        fmt.render([{"role": "tool", "content": "orphan result"}])
