"""From a generation request to the engine's :class:`SamplingParams`, checked against what the engine
represents: every number the step holds is in range here, so a bad request is a 400 naming its
field and never reaches (or fails) an engine step.

Field-by-field, the checks split between the pydantic models (:mod:`jaxdsa.serve.protocol`: types,
ranges that do not depend on the model, finite numbers) and this module (what depends on the
model or the prompt: token ids within the vocabulary, the context length, ``--max-logprobs``).
``docs/serving.md`` lists every field and where it is checked.
"""

from __future__ import annotations

from jaxdsa import text
from jaxdsa.engine import SamplingParams
from jaxdsa.engine.request import MAX_BANNED_TOKENS
from jaxdsa.serve import output
from jaxdsa.serve.context import ServingContext
from jaxdsa.serve.errors import ApiError
from jaxdsa.serve.output import TextOutput
from jaxdsa.serve.protocol import ChatCompletionRequest, CompletionRequest

GenerationRequest = ChatCompletionRequest | CompletionRequest


def check_token_ids(ids: list[int], vocabulary: int, param: str) -> None:
    """400 naming ``param`` unless every id is in [0, vocabulary)."""
    bad = next((t for t in ids if not 0 <= t < vocabulary), None)
    if bad is not None:
        raise ApiError(
            400,
            f"{param}: token id {bad} is outside the vocabulary [0, {vocabulary})",
            param=param,
            code="invalid_value",
        )


def check_prompt(ctx: ServingContext, ids: list[int], param: str) -> None:
    """A prompt the engine can run: not empty, ids in the vocabulary, room for one more token."""
    if not ids:
        raise ApiError(400, f"{param}: the prompt is empty", param=param, code="invalid_value")
    check_token_ids(ids, ctx.vocabulary, param)
    if len(ids) >= ctx.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {ctx.max_model_len} tokens; "
            f"the prompt has {len(ids)}, leaving none to generate.",
            param=param,
            code="context_length_exceeded",
        )


def sampling_params(
    ctx: ServingContext, body: GenerationRequest, prompt_len: int, default_max_tokens: int | None
) -> SamplingParams:
    """The engine's sampling for ``body`` after a prompt of ``prompt_len`` tokens (checked by
    :func:`check_prompt`); 400 naming the field for values the engine cannot honour."""
    remaining = ctx.max_model_len - prompt_len
    requested, max_tokens_param = body.requested_max_tokens
    if requested is not None and requested > remaining:
        raise ApiError(
            400,
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion).",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    logprobs, logprobs_param = body.logprobs_request()
    if logprobs is not None and logprobs > ctx.max_logprobs:
        raise ApiError(
            400,
            f"{logprobs_param} {logprobs} is above this server's --max-logprobs {ctx.max_logprobs}",
            param=logprobs_param,
        )
    max_tokens = requested or min(remaining, default_max_tokens or remaining)
    if body.min_tokens > max_tokens:
        raise ApiError(
            400, f"min_tokens {body.min_tokens} is above max_tokens {max_tokens}", param="min_tokens"
        )
    stop_token_ids = list(body.stop_token_ids or ())
    check_token_ids(stop_token_ids, ctx.vocabulary, "stop_token_ids")
    bias = body.logit_bias or {}
    check_token_ids(list(bias), ctx.vocabulary, "logit_bias")
    requested_sampling = text.SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=bias,
    )
    sp = text.engine_sampling(requested_sampling, ctx.default_sampling, max_tokens)
    held_back = sp.stop_ids(ctx.eos_token_ids)
    if sp.min_tokens and len(held_back) > MAX_BANNED_TOKENS:
        raise ApiError(
            400,
            f"stop_token_ids: min_tokens holds back at most {MAX_BANNED_TOKENS} EOS and stop token ids; "
            f"this request has {len(held_back)}",
            param="stop_token_ids",
        )
    return sp


def text_output(
    ctx: ServingContext, body: GenerationRequest, sp: SamplingParams, keep: tuple[str, ...] = ()
) -> TextOutput:
    """One choice's text: skipped special tokens (but the parsers' ``keep`` markers), stop
    strings, and its hidden stop tokens."""
    return output.text_output(
        ctx.tokenizer,
        ctx.eos_token_ids,
        sp,
        stop=body.stop,
        skip_special_tokens=body.skip_special_tokens,
        keep=keep,
    )
