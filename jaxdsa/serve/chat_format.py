"""Conversation -> prompt text, the way each model family was trained to read it.

GLM checkpoints ship a Jinja chat template (``chat_template`` in tokenizer_config.json, or
``chat_template.jinja``); it is rendered exactly as transformers' ``apply_chat_template`` does
(sandboxed environment, ``trim_blocks``/``lstrip_blocks``, ``tojson``, ``raise_exception``,
``strftime_now``, the special tokens and any ``chat_template_kwargs`` as variables).
DeepSeek-V3.2 and DeepSeek-V4 ship no template but Python encoders, which ``jaxdsa.serve.deepseek_encoding``
and ``jaxdsa.serve.deepseek_v4_encoding`` implement.

Thinking is switched the same way for every family: ``chat_template_kwargs`` ``enable_thinking``
(GLM's name) and ``thinking`` (DeepSeek's, in vLLM) are one switch (:func:`thinking_switch`), so
``{"enable_thinking": False}`` and ``{"thinking": False}`` each turn it off for GLM-5.x,
DeepSeek-V3.2 and DeepSeek-V4 alike; a Jinja template sees both keys set.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from jaxdsa.serve import deepseek_encoding, deepseek_v4_encoding

THINK_START = "<think>"
THINKING_KEYS = ("enable_thinking", "thinking")


def thinking_switch(kwargs: Mapping[str, Any]) -> bool | None:
    """The thinking switch of ``chat_template_kwargs``: None when neither ``enable_thinking`` nor
    ``thinking`` is given (the family's default), else on when one of the given keys is true (as
    vLLM's DeepSeek-V4 tokenizer reads the pair)."""
    given = [kwargs[k] for k in THINKING_KEYS if k in kwargs]
    return any(map(bool, given)) if given else None


def with_thinking_keys(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with both thinking keys set to the switch when one is given, so a template that
    reads either name (GLM's read ``enable_thinking``) follows it."""
    switch = thinking_switch(kwargs)
    return dict(kwargs) if switch is None else {**kwargs, **dict.fromkeys(THINKING_KEYS, switch)}


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or a field is malformed): HTTP 400."""


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    text: str
    thinking: bool  # the prompt opened a reasoning block: the reply starts inside <think>


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (HF's assistant-mask marker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class JinjaChatFormat:
    """A checkpoint's Jinja chat template, rendered like transformers does."""

    def __init__(self, template: str, special_tokens: Mapping[str, Any]):
        try:
            self._template = _environment().from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from e
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> ChatPrompt:
        variables = {
            "add_generation_prompt": True,
            **self._special_tokens,
            **with_thinking_keys(kwargs or {}),
        }
        variables |= {"messages": list(messages), "tools": tools or None, "documents": None}
        try:
            text = self._template.render(variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e
        return ChatPrompt(text, text.rstrip().endswith(THINK_START))


class DeepSeekChatFormat:
    """DeepSeek-V3.2's encoder. Thinking is off unless the switch (``thinking`` / ``enable_thinking``,
    :func:`thinking_switch`) is on or ``thinking_mode`` is ``"thinking"``."""

    label = "DeepSeek"

    def encode(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, kwargs
    ) -> str:
        thinking = bool(thinking_switch(kwargs))
        mode = kwargs.get("thinking_mode", "thinking" if thinking else "chat")
        return deepseek_encoding.encode_messages(messages, thinking_mode=mode, tools=tools)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> ChatPrompt:
        try:
            text = self.encode(messages, tools or None, kwargs or {})
        except (ValueError, KeyError, TypeError) as e:
            raise ChatTemplateError(f"{self.label} encoding: {e}") from e
        return ChatPrompt(text, text.endswith(THINK_START))


class DeepSeekV4ChatFormat(DeepSeekChatFormat):
    """DeepSeek-V4's encoder, with vLLM's V4 options: thinking is on unless ``thinking`` /
    ``enable_thinking`` is given and false (``thinking_mode`` "chat" / "thinking" overrides both);
    ``reasoning_effort`` "max" adds the effort prefix, "none" turns thinking off, any other value
    renders as "high" (which adds nothing, as in DeepSeek's release encoder); ``drop_thinking``
    (default true) drops older reasoning unless tools are present."""

    label = "DeepSeek-V4"

    @staticmethod
    def options(kwargs: Mapping[str, Any]) -> tuple[str, str | None]:
        """(thinking_mode, reasoning_effort) for the encoder from the chat template kwargs."""
        thinking = thinking_switch(kwargs) is not False
        mode = kwargs.get("thinking_mode", "thinking" if thinking else "chat")
        effort = kwargs.get("reasoning_effort")
        if effort == "none":
            mode, effort = "chat", None
        elif effort != "max":
            effort = None
        return mode, effort

    def encode(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, kwargs
    ) -> str:
        mode, effort = self.options(kwargs)
        return deepseek_v4_encoding.encode_messages(
            messages,
            thinking_mode=mode,
            tools=tools,
            reasoning_effort=effort,
            drop_thinking=bool(kwargs.get("drop_thinking", True)),
        )


ChatFormat = JinjaChatFormat | DeepSeekChatFormat | DeepSeekV4ChatFormat


def _template_text(model_dir: str, tokenizer_config: Mapping[str, Any]) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    path = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            template = fh.read()
    return template


def load_chat_format(
    model_dir: str, model_type: str, tokenizer_config: Mapping[str, Any], special_tokens: Mapping[str, Any]
) -> ChatFormat | None:
    """The family's chat format; None when the checkpoint has no template (chat requests get a 400)."""
    if model_type == "deepseek_v32":
        return DeepSeekChatFormat()
    if model_type == "deepseek_v4":
        return DeepSeekV4ChatFormat()
    template = _template_text(model_dir, tokenizer_config)
    return JinjaChatFormat(template, special_tokens) if template else None
