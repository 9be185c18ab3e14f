"""The OpenAI-compatible HTTP API (FastAPI): models, completions, chat completions, health, metrics.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or
SSE streams ending in ``data: [DONE]``), ``GET /health``, ``GET /metrics`` and vLLM's
``POST /tokenize`` / ``POST /detokenize`` (used by ``jaxdsa.serve.bench``), vLLM's ``POST /start_profile`` /
``POST /stop_profile`` (with ``--profile-dir``), one router each in
:mod:`jaxdsa.serve.routes`. The app never touches the model: it talks to the engine only through
``ServingContext.generate`` and ``.stats``, so tests can serve scripted outputs through the same code.
"""

from __future__ import annotations

import time

from fastapi import FastAPI

from jaxdsa.serve.context import AppState, ServingContext
from jaxdsa.serve.errors import install_error_handlers
from jaxdsa.serve.metrics import Metrics
from jaxdsa.serve.openapi import publish_without_422
from jaxdsa.serve.routes import chat, completions, health, models, profile, tokens

__all__ = ["ServingContext", "create_app"]


def create_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="jaxdsa", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.state.serving = AppState(ctx, Metrics(ctx.stats), started=int(time.time()))
    for routes in (health, models, tokens, completions, chat, profile):
        app.include_router(routes.router)
    publish_without_422(app)
    return app
