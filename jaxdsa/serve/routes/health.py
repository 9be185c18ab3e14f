"""``GET /health`` for load balancers and ``GET /metrics`` for Prometheus (both without an API key)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from jaxdsa.serve.context import State
from jaxdsa.serve.errors import ApiError, error_responses
from jaxdsa.serve.metrics import CONTENT_TYPE
from jaxdsa.serve.response_models import Health

router = APIRouter(tags=["health"])


@router.get(
    "/health",
    response_model=Health,
    responses=error_responses(503),
    summary="200 with {'status': 'ok'} while the engine runs, 503 once it has stopped",
)
async def health(state: State) -> JSONResponse:
    if not state.context.alive():
        raise ApiError(503, "the engine has stopped", code="engine_stopped")
    return JSONResponse({"status": "ok"})


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics (vLLM's names under a jaxdsa: prefix)",
)
async def prometheus(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
