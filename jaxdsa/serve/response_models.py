"""The response bodies as the OpenAPI document describes them (pydantic models, for the document).

The routes build their JSON as dicts (streaming chunks share the code), so these models do not
serialize anything: they tell clients, and the schema-conformance tests, what comes back.
Extra keys are allowed, as in OpenAI's own schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Health(BaseModel):
    status: Literal["ok"]


class Profiling(BaseModel):
    status: Literal["profiling", "written"]
    directory: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class Detokenized(BaseModel):
    prompt: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy shape; an echoed prompt's first token has null logprob and top tokens."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# One server-sent event of a stream: its data is a JSON chunk, an error object, or [DONE] last.
_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, an error, or [DONE]"}},
    "required": ["data"],
}


def generation_responses(model: type[BaseModel], stream_description: str) -> dict[int | str, dict]:
    """The 200 of a generation route: ``model`` as JSON, or (``stream: true``) server-sent events."""
    return {
        200: {
            "model": model,
            "description": f"The reply; with `stream: true`, {stream_description}",
            "content": {"text/event-stream": {"schema": _EVENT}},
        }
    }
