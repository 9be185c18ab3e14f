"""``GET /v1/models`` and ``GET /v1/models/{name}``: the names this server answers to."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from jaxdsa.serve.context import AppState, State, authorized
from jaxdsa.serve.errors import error_responses
from jaxdsa.serve.response_models import ModelCard, ModelList

router = APIRouter(tags=["models"], dependencies=[Depends(authorized)])


def _card(state: AppState, name: str) -> dict[str, Any]:
    ctx = state.context
    return {
        "id": name,
        "object": "model",
        "created": state.started,
        "owned_by": "jaxdsa",
        "root": ctx.model_path,
        "parent": None,
        "max_model_len": ctx.max_model_len,
    }


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
async def list_models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [_card(state, n) for n in state.context.model_names]}


@router.get("/v1/models/{name:path}", response_model=ModelCard, responses=error_responses(401, 404))
async def get_model(name: str, state: State) -> dict[str, Any]:
    return _card(state, state.context.model_name(name))
