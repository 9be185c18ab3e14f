"""The OpenAPI document the server publishes (``GET /openapi.json``).

FastAPI documents a 422 for every route with a body or parameters; this server answers request
validation errors with 400 in OpenAI's error shape instead (:mod:`jaxdsa.serve.errors`), which each route
documents with the other errors it gives, so the 422s and their schemas are taken out.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")


def publish_without_422(app: FastAPI) -> None:
    """Make ``app.openapi()`` return FastAPI's document without its 422 answers."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()  # cached by FastAPI in app.openapi_schema: edited once, here
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in _FASTAPI_VALIDATION_SCHEMAS:
                schemas.pop(name, None)
        return app.openapi_schema

    app.openapi = openapi
