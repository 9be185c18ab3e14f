"""Request state and sampling parameters (plain Python, no JAX)."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from typing import Any


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or a stop string (decided by the caller)
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine could not run it (RequestOutput.error says why); other requests go on


# Tokens a step can keep a request from sampling (its EOS ids and stop_token_ids while under
# min_tokens): a fixed width, so the step's shapes never depend on it.
MAX_BANNED_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the sampled token's logprob and the n most likely
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled (nor end the request) before this many
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = (
        1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    )
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits

    def __post_init__(self):
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def penalized(self) -> bool:
        """Whether a penalty or a logit bias is on (such requests need their slot's token state
        filled, and their sampled tokens counted)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or bool(self.logit_bias)
        )

    def stop_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """Tokens that end the request: its stop_token_ids, and EOS unless it ignores EOS."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else eos_token_ids)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    output: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(
        default_factory=list
    )  # prefix-cache ids of its full computed pages
    num_computed: int = 0  # tokens whose latent rows are in the cache
    slot: int | None = None  # page-table row while running
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    draft: list[int] = dataclasses.field(default_factory=list)  # tokens the MTP layer proposed to follow
    # tokens sampled by steps still running on the device (async scheduling): they follow ``output``,
    # count towards its length and its positions, and reach the host one step later
    pending: int = 0

    @property
    def tokens(self) -> list[int]:
        """Prompt and output tokens the host knows (the pending ones come after them)."""
        return self.prompt + self.output

    @property
    def num_output(self) -> int:
        """Output tokens sampled so far, the pending ones included."""
        return len(self.output) + self.pending

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.num_output

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability under the model, with the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclasses.dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    logits: Any = None  # float32 [vocab] the token was sampled from, when the request asked for it
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = (
        None  # with the first token, when asked: one per prompt token
    )
    error: str | None = None  # why the engine failed the request (finish_reason ERROR)
    cache_image: Any = None  # an exported request's cache (jaxdsa.engine.handoff.CacheImage), when it ends
