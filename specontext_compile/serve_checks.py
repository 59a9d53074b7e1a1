"""What ``specontext serve`` checks in a request before Hugging Face's handlers see it.

Hugging Face's server checks only the *names* of a request's fields (an unknown one: 422).
A value it cannot use reached its engine and failed there: ``"max_tokens": "abc"`` and
empty ``messages`` gave a 500, ``"max_tokens": -100`` with a long prompt passed the capacity
check, failed the scheduler and killed the engine thread (every later request: 503). Here
every value the handlers read is validated by pydantic first (a 422 naming the field), and a
request its KV cache cannot hold is refused with a 400 naming the fix.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

import pydantic

__all__ = ["ENGINE_GENERATION_KEYS", "ChatRequest", "CompletionRequest", "ResponseRequest", "check_capacity",
           "check_honoured", "check_request", "ignored_fields", "request_capacity"]


#: fields the continuous-batching engine applies from a request's ``generation_config`` (JSON):
#: Hugging Face's ``_build_continuous_batching_kwargs`` takes these and drops every other key
ENGINE_GENERATION_KEYS = frozenset({"max_new_tokens", "eos_token_id", "do_sample", "temperature", "top_k", "top_p",
                                    "seed"})

#: fields of every endpoint the engine would not apply: name -> (the values that ask nothing of
#: it, which a request may send; the fix named in the refusal)
_NOT_APPLIED = {
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

#: ``/v1/chat/completions`` only (Hugging Face's ``UNUSED_CHAT_COMPLETION_FIELDS`` that change an answer)
_CHAT_NOT_APPLIED = {
    "functions": ((None, []), "describe them as 'tools' (the chat template renders those)"),
    "function_call": ((None, "auto"), "leave it out: the model chooses whether to call a tool"),
    "tool_choice": ((None, "auto"), "leave it out: the model chooses whether to call a tool"),
    "modalities": ((None, ["text"]), "leave it out: this server answers in text"),
    "audio": ((None,), "leave it out: this server answers in text"),
    "web_search_options": ((None,), "leave it out: this server does not search the web"),
    "reasoning_effort": ((None,), "leave it out: the engine does not set a reasoning effort"),
}

_NO_STATE = "send the earlier turns in 'input': this server keeps no responses or conversations"

#: ``/v1/responses`` only (Hugging Face's ``UNUSED_RESPONSE_FIELDS`` that change an answer, and
#: the fields its handler never reads)
_RESPONSES_NOT_APPLIED = {
    "previous_response_id": ((None,), _NO_STATE),
    "conversation": ((None,), _NO_STATE),
    "prompt": ((None,), "send the prompt template's text as 'instructions' and 'input'"),
    "text": ((None, {"format": {"type": "text"}}), "leave it out: the engine does not constrain its output"),
    "top_logprobs": _NOT_APPLIED["top_logprobs"],
    "include": ((None, []), "leave it out: this server adds nothing to its answers"),
    "background": ((None, False), "leave it out: the answer comes when it is done (or stream it)"),
    "tool_choice": _CHAT_NOT_APPLIED["tool_choice"],
    "max_tool_calls": ((None,), "leave it out: the engine does not count tool calls"),
    "reasoning": _CHAT_NOT_APPLIED["reasoning_effort"],
}


class _Generation(pydantic.BaseModel):
    """The generation fields every endpoint's handler reads (OpenAI's ranges); other fields
    pass to Hugging Face's own check of names. ``not_applied``: the fields the engine would
    answer as if absent (:func:`ignored_fields`)."""

    model_config = pydantic.ConfigDict(extra="allow")
    not_applied: ClassVar[dict[str, tuple[tuple, str]]] = {}

    model: str | None = None
    temperature: float | None = pydantic.Field(None, ge=0, le=2)
    top_p: float | None = pydantic.Field(None, gt=0, le=1)
    seed: int | None = None
    stream: bool | None = None
    generation_config: str | None = None


class _Sampling(_Generation):
    """The fields the chat and text completions handlers read besides."""

    max_tokens: int | None = pydantic.Field(None, ge=1)
    frequency_penalty: float | None = pydantic.Field(None, ge=-2, le=2)
    stop: str | list[pydantic.constr(min_length=1)] | None = None


class _Message(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    """``/v1/chat/completions``: at least one message."""

    not_applied: ClassVar[dict[str, tuple[tuple, str]]] = {**_NOT_APPLIED, **_CHAT_NOT_APPLIED}

    messages: list[_Message] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = pydantic.Field(None, ge=1)


class CompletionRequest(_Sampling):
    """``/v1/completions``: a non-empty prompt."""

    not_applied: ClassVar[dict[str, tuple[tuple, str]]] = _NOT_APPLIED

    prompt: str | list[str] = pydantic.Field(min_length=1)


class ResponseRequest(_Generation):
    """``/v1/responses``: a non-empty ``input`` (text, or a list of messages and items)."""

    not_applied: ClassVar[dict[str, tuple[tuple, str]]] = _RESPONSES_NOT_APPLIED

    input: str | list[dict[str, Any]] = pydantic.Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = pydantic.Field(None, ge=1)


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


def ignored_fields(body: dict, samples: bool, schema: type[_Generation] = ChatRequest) -> list[str]:
    """One line per field of ``body`` that this server would not apply, naming the fix.

    ``schema``: the endpoint's (:class:`ChatRequest`, :class:`CompletionRequest`,
    :class:`ResponseRequest`); its ``not_applied`` fields are refused at any value but their
    neutral ones, and so is a ``generation_config`` (JSON) with a key the engine drops
    (:data:`ENGINE_GENERATION_KEYS`). ``samples``: whether the model's generation config
    samples. A request samples when it sets ``temperature > 0``, or sets none on a model that
    samples; ``top_p < 1`` on a request that does not sample would do nothing.
    """
    problems = []
    for name, (neutral, fix) in schema.not_applied.items():
        value = body.get(name)
        if value not in neutral:
            problems.append(f"'{name}': {value!r} is not applied by this server's engine; {fix}")
    requested = _parsed(body.get("generation_config"))
    problems += _generation_config_problems(requested)
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if isinstance(temperature, (int, float)):
        sampling = temperature > 0
    elif isinstance(requested, dict) and "do_sample" in requested:  # as Hugging Face merges it
        sampling = bool(requested["do_sample"]) and requested.get("temperature") != 0
    else:
        sampling = samples
    if not sampling and isinstance(top_p, (int, float)) and top_p < 1:
        problems.append(f"'top_p': {top_p!r} applies when sampling, and this request decodes greedily (by its "
                        f"temperature {temperature!r}, its generation_config's do_sample, or else the model's "
                        f"generation config): set temperature > 0 or leave top_p out")
    return problems


def _parsed(text: Any) -> Any:
    """``text`` read as JSON; the ``ValueError`` itself when it is not JSON, None when it is no string."""
    if not isinstance(text, str):
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        return exc


def _generation_config_problems(requested: Any) -> list[str]:
    """The request's ``generation_config`` (a JSON object, as a string; here :func:`_parsed`)
    must name only keys the engine applies: Hugging Face's handler merged any key, and the
    engine dropped the others."""
    if requested is None:
        return []
    if isinstance(requested, ValueError):
        return [f"'generation_config' is not JSON ({requested}); send a JSON object of generation settings as a "
                "string"]
    if not isinstance(requested, dict):
        return [f"'generation_config' must be a JSON object, got {type(requested).__name__}"]
    dropped = sorted(set(requested) - ENGINE_GENERATION_KEYS)
    if not dropped:
        return []
    return [f"'generation_config': {', '.join(map(repr, dropped))} not applied by this server's engine; it applies "
            f"only {', '.join(sorted(ENGINE_GENERATION_KEYS))}"]


def check_honoured(body: dict, samples: bool, schema: type[_Generation] = ChatRequest) -> None:
    """Refuse a request that asks for something the engine would silently not do
    (:func:`ignored_fields`): Hugging Face's server logged a warning, at most once, and answered
    as if the field were absent.

    Raises:
        fastapi.HTTPException: 400 listing each such field with its fix.
    """
    from fastapi import HTTPException

    problems = ignored_fields(body, samples, schema)
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
