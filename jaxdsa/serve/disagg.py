"""The HTTP side of disaggregated serving: what a request's ``kv_transfer_params`` asks of this
server (vLLM's protocol, :mod:`jaxdsa.kv_transfer.connector`) and what its response carries.

``{"do_remote_decode": true}``: this server is the prefill side. The request samples one token
(whatever ``max_tokens`` says, as vLLM's proxy sets it), is answered as one JSON response, and the
response's ``kv_transfer_params`` tell a decode server where to read the request's cache.
``{"do_remote_prefill": true, ...}`` (those params): this server is the decode side. The request's
cache is read from the prefill server before it decodes; its first token is the one the prefill
side sampled. Either needs ``--kv-transfer-config`` with the matching ``kv_role``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxdsa.engine import SamplingParams
from jaxdsa.kv_transfer.agent import TransferError
from jaxdsa.serve.context import ServingContext
from jaxdsa.serve.errors import ApiError
from jaxdsa.serve.generation import Generation
from jaxdsa.serve.protocol import ChatCompletionRequest, CompletionRequest

PARAM = "kv_transfer_params"


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What a request's kv_transfer_params make of it: ``export`` (prefill side) or a ``source``
    its cache comes from (decode side); neither for a plain request."""

    export: bool = False
    source: Any = None

    def sampling(self, sp: SamplingParams) -> SamplingParams:
        return dataclasses.replace(sp, max_tokens=1) if self.export else sp

    def engine_kwargs(self) -> dict[str, Any]:
        """What ``generate`` passes to the engine's ``add_request`` for it."""
        if self.export:
            return {"export": True}
        return {"source": self.source} if self.source is not None else {}


async def handoff(
    ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest, prompts: int
) -> Handoff:
    """The request's :class:`Handoff`; 400 for params this server cannot serve, 503 when the
    cache they name can no longer be read (its lease ran out)."""
    params = body.kv_transfer_params
    if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
        return Handoff()
    kv = ctx.kv
    if kv is None:
        raise ApiError(400, "this server was started without --kv-transfer-config", param=PARAM)
    if body.n != 1 or prompts != 1:
        raise ApiError(400, "a request handed between servers has one prompt and n = 1", param=PARAM)
    if params.get("do_remote_decode"):
        if not kv.config.produces:
            raise ApiError(
                400,
                f"this server's kv_role is {kv.config.kv_role}: it does not prefill for others",
                param=PARAM,
            )
        if body.stream:
            raise ApiError(
                400,
                "a prefill for a decode server is answered as one JSON response: stream must be false",
                param=PARAM,
            )
        return Handoff(export=True)
    if not kv.config.consumes:
        raise ApiError(
            400, f"this server's kv_role is {kv.config.kv_role}: it does not decode for others", param=PARAM
        )
    try:
        return Handoff(source=kv.source(params))
    except ValueError as e:
        raise ApiError(400, str(e), param=PARAM) from e
    except TransferError as e:
        raise ApiError(503, str(e), code="kv_transfer_error") from e


def response_params(ctx: ServingContext, gens: list[Generation]) -> dict[str, Any]:
    """``{"kv_transfer_params": ...}`` for a prefill response (the request's cache offered to a
    decode server), else nothing: merged into the response body."""
    if len(gens) != 1 or gens[0].cache_image is None:
        return {}
    return {PARAM: ctx.kv.offer(gens[0].cache_image)}
