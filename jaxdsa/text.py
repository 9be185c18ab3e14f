"""Text in and out of :meth:`jaxdsa.LLM.generate` and :meth:`jaxdsa.LLM.chat`, shaped as vLLM's.

:class:`SamplingParams` is vLLM's (``n``, ``temperature``, ``max_tokens``, ``stop``, ...); the
engine's own :class:`jaxdsa.engine.SamplingParams` holds only what a step needs, so stop strings
and ``skip_special_tokens`` live here. :class:`RequestOutput` / :class:`CompletionOutput` are what
vLLM's ``LLM.generate`` returns. Sampling left unset takes the checkpoint's
``generation_config.json`` values (:func:`generation_defaults`), as a server request does.

The server maps its requests through the same code (:func:`engine_sampling`,
:func:`choice_sampling`), and the text itself (detokenizing, stop strings, chat formats, reasoning
and tool-call parsing) comes from ``jaxdsa.serve``'s FastAPI-free modules (``jaxdsa.serve.tokenizer``,
``jaxdsa.serve.chat_format``, ``jaxdsa.serve.output``, ...), which :mod:`jaxdsa.llm` imports when text
is first used: ``import jaxdsa`` itself imports neither ``jaxdsa.serve`` nor FastAPI.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdsa.engine import SamplingParams as EngineSamplingParams
from jaxdsa.engine import TokenLogprobs

# (reasoning parser, tool-call parser) of each model type, by their --reasoning-parser /
# --tool-call-parser names: what ``LLM.chat`` parses replies with. The server parses only with those
# flags, as vLLM does (docs/serving.md names the same pairs).
FAMILY_PARSERS: dict[str, tuple[str, str]] = {
    "glm_moe_dsa": ("glm45", "glm47"),
    "deepseek_v32": ("deepseek_v3", "deepseek_v32"),
    "deepseek_v4": ("deepseek_v4", "deepseek_v4"),
}

# The generation_config.json fields that are default sampling parameters (vLLM's --generation-config auto).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k")


def generation_defaults(directory: str | os.PathLike) -> dict[str, Any]:
    """Default sampling parameters from ``directory``'s generation_config.json ({} without one)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    return {k: config[k] for k in GENERATION_DEFAULT_FIELDS if k in config}


@dataclasses.dataclass
class SamplingParams:
    """vLLM's sampling parameters for text generation.

    ``temperature`` / ``top_p`` / ``top_k`` left as None take the checkpoint's generation_config.json
    values, else 1.0 / 1.0 / off (what a server request that omits them gets). ``top_k`` -1 or 0 is
    off. ``max_tokens`` None: up to the context length. ``stop``: strings that end a completion (not
    included in its text); ``stop_token_ids`` end it too (hidden, like EOS, which ends it unless
    ``ignore_eos``). ``seed``: the completion's (choice j of ``n`` uses seed + j). ``logprobs`` /
    ``prompt_logprobs``: that many top alternatives per generated / prompt token.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None

    @classmethod
    def of(cls, sp: SamplingParams | EngineSamplingParams | None) -> SamplingParams:
        """``sp`` as these parameters: None is the defaults; the engine's are taken field by field."""
        if sp is None:
            return cls()
        if isinstance(sp, cls):
            return sp
        if isinstance(sp, EngineSamplingParams):
            fields = {f.name: getattr(sp, f.name) for f in dataclasses.fields(EngineSamplingParams)}
            return cls(**fields | {"logit_bias": dict(sp.logit_bias)})
        raise TypeError(f"sampling_params: expected jaxdsa.SamplingParams, got {type(sp).__name__}")

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop: stop strings must be non-empty strings")
        return stops


def engine_sampling(sp: SamplingParams, defaults: Mapping[str, Any], max_tokens: int) -> EngineSamplingParams:
    """The engine's sampling for ``sp`` with ``max_tokens`` settled: unset values from ``defaults``
    (generation_config.json's), top_k -1 as off, the logit bias as sorted pairs. The engine's own
    checks (``SamplingParams.__post_init__``) raise ValueError for numbers it cannot hold."""
    top_k = sp.top_k if sp.top_k is not None else defaults.get("top_k", 0)
    return EngineSamplingParams(
        max_tokens=max_tokens,
        temperature=sp.temperature if sp.temperature is not None else defaults.get("temperature", 1.0),
        top_p=sp.top_p if sp.top_p is not None else defaults.get("top_p", 1.0),
        top_k=max(top_k, 0),  # -1 and 0 mean off; so do values past the vocabulary (the engine's reading)
        seed=sp.seed,  # any int64; the engine reduces it to its 31 bits
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs,
        prompt_logprobs=sp.prompt_logprobs,
        min_tokens=sp.min_tokens,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        logit_bias=tuple(sorted((sp.logit_bias or {}).items())),
    )


def choice_sampling(sp: EngineSamplingParams, n: int) -> list[EngineSamplingParams]:
    """The sampling of each of ``n`` choices: a seeded request's choice j uses seed + j, so the
    choices differ and each one is reproducible (unseeded ones get distinct derived seeds)."""
    return [sp if sp.seed is None else dataclasses.replace(sp, seed=sp.seed + j) for j in range(n)]


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's): its text (EOS and stop tokens hidden, cut before a stop
    string), every token id the engine generated for it (a final EOS or stop token included), and
    why it ended: "stop" (EOS, a stop token or string), "length", or for chat "tool_calls".

    From :meth:`jaxdsa.LLM.chat` also the reply as the server's ``/v1/chat/completions`` parses it:
    ``content``, ``reasoning_content`` (None unless the reply reasoned), ``tool_calls`` (OpenAI's
    dicts; None without calls) and ``message``, that assistant message, ready to append to the
    conversation. ``text`` is then the raw reply the parsers read (their markers kept).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    message: dict[str, Any] | None = None


@dataclasses.dataclass
class RequestOutput:
    """One prompt's result (vLLM's): the prompt text (for chat the rendered conversation; None for
    token-id prompts), its token ids and ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = True
