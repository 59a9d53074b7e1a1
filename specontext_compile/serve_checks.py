"""What ``specontext serve`` checks in a request before Hugging Face's handlers see it.

Hugging Face's server checks only the *names* of a request's fields (an unknown one: 422).
A value it cannot use reached its engine and failed there: ``"max_tokens": "abc"`` and
empty ``messages`` gave a 500, ``"max_tokens": -100`` with a long prompt passed the capacity
check, failed the scheduler and killed the engine thread (every later request: 503). Here
every value the handlers read is validated by pydantic first (a 422 naming the field), and a
request its KV cache cannot hold is refused with a 400 naming the fix.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

__all__ = ["ChatRequest", "CompletionRequest", "check_capacity", "check_honoured", "check_request", "ignored_fields",
           "request_capacity"]


class _Sampling(pydantic.BaseModel):
    """The generation fields Hugging Face's handlers read (OpenAI's ranges); other fields pass
    to Hugging Face's own check of names."""

    model_config = pydantic.ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = pydantic.Field(None, ge=1)
    temperature: float | None = pydantic.Field(None, ge=0, le=2)
    top_p: float | None = pydantic.Field(None, gt=0, le=1)
    frequency_penalty: float | None = pydantic.Field(None, ge=-2, le=2)
    seed: int | None = None
    stream: bool | None = None
    stop: str | list[pydantic.constr(min_length=1)] | None = None


class _Message(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    """``/v1/chat/completions``: at least one message."""

    messages: list[_Message] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = pydantic.Field(None, ge=1)


class CompletionRequest(_Sampling):
    """``/v1/completions``: a non-empty prompt."""

    prompt: str | list[str] = pydantic.Field(min_length=1)


def check_request(body: dict, schema: type[pydantic.BaseModel]) -> None:
    """Validate ``body`` against ``schema``.

    Raises:
        fastapi.HTTPException: 422 with one ``{"loc", "msg", "type"}`` entry per bad field
            (the value itself is left out: a prompt can be megabytes).
    """
    from fastapi import HTTPException

    try:
        schema.model_validate(body)
    except pydantic.ValidationError as exc:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        raise HTTPException(status_code=422, detail=errors) from None


#: OpenAI fields Hugging Face's continuous-batching engine does not apply, each with the value
#: values that ask nothing of it (a request may send those) and the fix named in the refusal
_IGNORED = {
    "n": ((None, 1), "send n requests (one choice per request here)"),
    "best_of": ((None, 1), "send several requests and pick yourself"),
    "echo": ((None, False), "prepend the prompt yourself"),
    "logprobs": ((None, False, 0), "leave it out: this server returns no log-probabilities"),
    "top_logprobs": ((None, 0), "leave it out: this server returns no log-probabilities"),
    "logit_bias": ((None, {}), "leave it out: the engine applies no logit bias"),
    "frequency_penalty": ((None, 0), "leave it out: the engine applies no penalties"),
    "presence_penalty": ((None, 0), "leave it out: the engine applies no penalties"),
    "response_format": ((None, {"type": "text"}), "leave it out: the engine does not constrain its output"),
}


def ignored_fields(body: dict, samples: bool) -> list[str]:
    """One line per field of ``body`` that this server would not apply, naming the fix.

    ``samples``: whether the model's generation config samples. A request samples when it sets
    ``temperature > 0``, or sets none on a model that samples; ``top_p < 1`` on a request that
    does not sample would do nothing.
    """
    problems = []
    for name, (neutral, fix) in _IGNORED.items():
        value = body.get(name)
        if value not in neutral:
            problems.append(f"'{name}': {value!r} is not applied by this server's engine; {fix}")
    temperature, top_p = body.get("temperature"), body.get("top_p")
    sampling = temperature > 0 if isinstance(temperature, (int, float)) else samples
    if not sampling and isinstance(top_p, (int, float)) and top_p < 1:
        problems.append(f"'top_p': {top_p!r} applies when sampling, and this request decodes greedily (temperature "
                        f"{temperature!r}, or none on a model whose generation config does not sample): set "
                        f"temperature > 0 or leave top_p out")
    return problems


def check_honoured(body: dict, samples: bool) -> None:
    """Refuse a request that asks for something the engine would silently not do
    (:func:`ignored_fields`): Hugging Face's server logged a warning, at most once, and answered
    as if the field were absent.

    Raises:
        fastapi.HTTPException: 400 listing each such field with its fix.
    """
    from fastapi import HTTPException

    problems = ignored_fields(body, samples)
    if problems:
        raise HTTPException(status_code=400, detail="; ".join(problems))


def request_capacity(cb_config) -> int | None:
    """Tokens (prompt plus generated) one request may hold in the engine's KV cache: its
    pages (``num_blocks``, at most ``max_blocks_per_request``) times ``page_size``; None when
    Hugging Face sizes the cache itself (``num_blocks`` unset)."""
    blocks = cb_config.num_blocks
    if not blocks:
        return None
    per_request = getattr(cb_config, "max_blocks_per_request", None)
    if per_request:
        blocks = min(blocks, per_request)
    return blocks * cb_config.page_size


def check_capacity(prompt_tokens: int, max_new_tokens: int | None, capacity: int | None) -> None:
    """Refuse a request whose prompt plus new tokens (at least one) passes ``capacity`` tokens.

    Raises:
        fastapi.HTTPException: 400 naming the fix (shorter prompt, lower ``max_tokens``, a
            server with more cache).
    """
    from fastapi import HTTPException

    new = max(max_new_tokens or 0, 1)
    if capacity is not None and prompt_tokens + new > capacity:
        raise HTTPException(status_code=400, detail=(
            f"the request needs {prompt_tokens} prompt + {new} new tokens of KV cache, more than the {capacity} "
            f"tokens one request may hold on this server: shorten the prompt or lower max_tokens, or start "
            f"the server with more cache (num_blocks x page_size)"))
