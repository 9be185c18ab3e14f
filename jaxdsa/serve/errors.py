"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every failure a client can cause or meet is an :class:`ApiError`; FastAPI's own validation
errors (422 by default) are turned into 400s that name the offending field, as OpenAI does.
:func:`error_responses` documents them in the OpenAPI document with :class:`ErrorResponse`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "bad_gateway_error",
    503: "service_unavailable_error",
}


_WHEN = {
    400: "Invalid request: bad JSON, a field out of range (`param` names it) or a prompt too long.",
    401: "Missing or wrong API key (the server runs with --api-key).",
    404: "No such model (`param`: model), or profiling is off (the server runs without --profile-dir).",
    429: "More requests in flight than --max-num-seqs + --max-queue-len; retry after `Retry-After`.",
    503: "The engine could not run this request (other requests are unaffected), or it stopped.",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries documenting these error statuses with OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": _WHEN[status]} for status in statuses}


class ApiError(Exception):
    """A failure answered as ``status`` with OpenAI's error body. ``code`` names the failure (the
    server's codes are strings); the prefill-decode router puts the HTTP status there, as vLLM's
    errors do."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse(self) -> str:
        """The error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> ApiError:
    error = exc.errors()[0]
    if error.get("type") == "json_invalid":
        return ApiError(
            400, f"invalid JSON body: {error.get('ctx', {}).get('error', error['msg'])}", code="invalid_json"
        )
    param = _param(tuple(error.get("loc", ())))
    if param is None and error.get("type") in ("model_attributes_type", "dict_type"):
        # a body that is not a JSON object (FastAPI reads a body sent without a JSON content type as text)
        return ApiError(
            400,
            "the request body must be a JSON object, sent as Content-Type: application/json",
            code="invalid_json",
        )
    message = error["msg"].removeprefix("Value error, ")
    if error.get("type") == "missing" and param:
        message = "this field is required"
    return ApiError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()
