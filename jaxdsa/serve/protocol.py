"""Request bodies of the OpenAI endpoints (plus vLLM's sampling extensions), validated by pydantic.

Unknown fields are ignored, as OpenAI-compatible servers do. Fields the engine cannot honour
(beam search, ``best_of``, ...) are rejected with a 400 naming the
field rather than being silently ignored, because ignoring them would change what the client
gets without telling it. Numbers must be finite (JSON's ``NaN`` / ``Infinity`` extensions are
400s). What depends on the model (token ids within its vocabulary, the context length) is
checked in :mod:`jaxdsa.serve.sampling_params`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# field -> the values that mean "off"; anything else is unsupported.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "use_beam_search": (None, False),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's bounds for seeds


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0 both mean "off" (vLLM uses -1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # reduced to the engine's 31 bits
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)  # choices per prompt, each its own engine request (OpenAI's limit)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)  # vLLM's: EOS, stop_token_ids and stop strings wait for this many tokens
    skip_special_tokens: bool = True

    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)  # vLLM's: > 1 discourages prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id (a JSON string key) -> bias in [-100, 100]

    # prefill-decode disaggregation (vLLM's): what this server does for another (jaxdsa.serve.disagg)
    kv_transfer_params: dict[str, Any] | None = None

    best_of: Any = None
    suffix: Any = None
    use_beam_search: Any = None

    @field_validator(*_UNSUPPORTED_DEFAULTS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in _UNSUPPORTED_DEFAULTS[info.field_name]:
            raise ValueError("not supported by this server")
        return value

    @property
    def include_usage(self) -> bool:
        """Streams end with a usage chunk (``stream_options.include_usage``)."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the completion length asked for, or None; the field that asked)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and any(not -100 <= bias <= 100 for bias in value.values()):
            raise ValueError("biases must be in [-100, 100]")
        if value and any(token < 0 for token in value):
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)  # the legacy shape: how many top tokens per position
    echo: bool = False  # the prompt comes back before the completion (with its logprobs, if asked)

    def logprobs_request(self) -> tuple[int | None, str]:
        """(top tokens per position, or None for no logprobs; the field that asked)."""
        return self.logprobs, "logprobs"

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        ok = isinstance(value, str) or (
            isinstance(value, list)
            and value
            and (
                all(isinstance(p, str) for p in value)
                or all(isinstance(t, int) and not isinstance(t, bool) for t in value)
                or all(
                    isinstance(p, list)
                    and p
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                    for p in value
                )
            )
        )
        if not ok:
            raise ValueError(
                "must be a string, a non-empty list of strings, a list of token ids "
                "or a list of token-id lists"
            )
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


def _text_of(content: Any) -> str | None:
    """Message content: a string, or text parts joined with newlines (vLLM's "string" format)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or "type" not in part:
            raise ValueError(f"part {i} must be an object with a type")
        if part["type"] != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"part {i}: type {part['type']!r} is not supported (text parts only)")
        texts.append(part["text"])
    return "\n".join(texts)


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, value: str | dict[str, Any]) -> dict[str, Any]:
        """Templates index arguments as a mapping, so OpenAI's JSON string is decoded here."""
        if isinstance(value, dict):
            return value
        try:
            args = json.loads(value or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from e
        if not isinstance(args, dict):
            raise ValueError("must be a JSON object")
        return args


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may read fields OpenAI does not define

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        return _text_of(value)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, Any]


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs to be true")
        return value

    def logprobs_request(self) -> tuple[int | None, str]:
        """(top tokens per position, or None for no logprobs; the field that asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None, "top_logprobs"

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "text") != "text":
            raise ValueError("only {'type': 'text'} is supported (no structured output)")
        return value

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat format and the tool parsers read them (None without tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as templates expect them: unset fields absent, but ``content`` always there."""
    return [{"content": m.content, **m.model_dump(exclude_none=True)} for m in messages]


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]
