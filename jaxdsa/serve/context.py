"""What every route shares: the model and engine behind the API, the app's metrics, and the FastAPI
dependencies that hand them to a route and check its API key.

The routes never touch the model: they reach the engine only through ``ServingContext.generate``
and ``.stats``, so tests can serve scripted outputs through the same code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request

from jaxdsa.serve.chat_format import ChatFormat, ChatPrompt, ChatTemplateError
from jaxdsa.serve.errors import ApiError
from jaxdsa.serve.generation import GenerateFn
from jaxdsa.serve.metrics import Metrics
from jaxdsa.serve.tokenizer import Tokenizer


class Profiler(Protocol):
    """What the profile routes drive (:class:`jaxdsa.engine.AsyncEngine`'s methods of these names)."""

    profile_dir: str | None

    def start_profile(self) -> None: ...

    def stop_profile(self) -> None: ...


@dataclasses.dataclass
class ServingContext:
    """Everything the HTTP layer needs about the model and the engine."""

    generate: GenerateFn  # AsyncEngine.generate
    stats: Callable[[], dict[str, float]]  # Engine.stats
    tokenizer: Tokenizer
    chat_format: ChatFormat | None
    model_names: list[str]
    max_model_len: int
    eos_token_ids: frozenset[int]
    model_path: str = ""
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    enable_auto_tool_choice: bool = False
    default_sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # from generation_config.json
    api_key: str | None = None
    max_logprobs: int = 20  # the engine's limit on top logprobs per token
    vocab_size: int | None = None  # the model's (its embedding rows); default: the tokenizer's
    alive: Callable[[], bool] = lambda: True  # whether the engine still runs (AsyncEngine.is_alive)
    profiler: Profiler | None = None  # the engine, when the server records traces (--profile-dir)
    kv: Any = None  # the jaxdsa.kv_transfer.connector.KVConnector, with --kv-transfer-config

    @property
    def vocabulary(self) -> int:
        """Token ids a request may name are below this."""
        return self.vocab_size if self.vocab_size is not None else self.tokenizer.vocab_size

    def model_name(self, requested: str | None) -> str:
        """The served name a request asked for (the first when it names none); 404 otherwise."""
        if requested is not None and requested not in self.model_names:
            raise ApiError(
                404, f"The model `{requested}` does not exist.", param="model", code="model_not_found"
            )
        return requested or self.model_names[0]

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> ChatPrompt:
        """The chat template's prompt; 400 naming ``messages`` when the template cannot render it."""
        if self.chat_format is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            return self.chat_format.render(messages, tools, kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from e


@dataclasses.dataclass
class AppState:
    """One app's serving state, kept in ``app.state.serving``."""

    context: ServingContext
    metrics: Metrics
    started: int  # Unix time the app was made: the models' ``created``


def app_state(request: Request) -> AppState:
    return request.app.state.serving


State = Annotated[AppState, Depends(app_state)]


async def authorized(request: Request, state: State) -> None:
    """With ``--api-key``, the API routes need ``Authorization: Bearer <key>`` (401 otherwise)."""
    key = state.context.api_key
    if key and request.headers.get("authorization") != f"Bearer {key}":
        raise ApiError(
            401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
        )
