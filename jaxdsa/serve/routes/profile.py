"""vLLM's ``POST /start_profile`` and ``POST /stop_profile``: a ``jax.profiler`` trace of the engine
while it serves, written to the server's ``--profile-dir`` (404 when it runs without one). Each
engine step is one annotated range in the trace; ``python -m benchmarks.anatomy`` reads a decode
step's anatomy from it."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from jaxdsa.serve.context import State, authorized
from jaxdsa.serve.errors import ApiError, error_responses
from jaxdsa.serve.response_models import Profiling

router = APIRouter(tags=["profile"], dependencies=[Depends(authorized)])


async def _switch(state, start: bool) -> dict[str, str]:
    profiler = state.context.profiler
    if profiler is None:
        raise ApiError(404, "profiling is off: start the server with --profile-dir", code="profiling_off")
    try:
        await asyncio.to_thread(profiler.start_profile if start else profiler.stop_profile)
    except RuntimeError as e:
        raise ApiError(400, str(e), code="profiling") from None
    return {"status": "profiling" if start else "written", "directory": profiler.profile_dir}


@router.post(
    "/start_profile",
    response_model=Profiling,
    responses=error_responses(400, 401, 404),
    summary="start recording a jax.profiler trace into --profile-dir",
)
async def start_profile(state: State) -> dict[str, str]:
    return await _switch(state, True)


@router.post(
    "/stop_profile",
    response_model=Profiling,
    responses=error_responses(400, 401, 404),
    summary="stop the trace and write it (a perfetto trace beside XLA's files)",
)
async def stop_profile(state: State) -> dict[str, str]:
    return await _switch(state, False)
