"""The request checks of ``specontext serve`` without a server: the capacity rule (a request
needs its prompt plus at least one new token of KV cache), the value schemas, and the
fields each endpoint refuses because the engine would answer as if they were absent."""

from __future__ import annotations

import json

import pytest
from fastapi import HTTPException
from hypothesis import given
from hypothesis import strategies as st

from specontext_compile.serve_checks import (ENGINE_GENERATION_KEYS, ChatRequest, CompletionRequest, ResponseRequest,
                                             check_capacity, check_honoured, check_request, ignored_fields)


@given(prompt=st.integers(0, 5000), new=st.one_of(st.none(), st.integers(-10_000, 5000)),
       capacity=st.one_of(st.none(), st.integers(1, 4096)))
def test_capacity_refuses_exactly_when_prompt_and_one_or_more_new_tokens_do_not_fit(prompt, new, capacity):
    fits = capacity is None or prompt + max(new or 0, 1) <= capacity
    if fits:
        check_capacity(prompt, new, capacity)
    else:
        with pytest.raises(HTTPException) as err:
            check_capacity(prompt, new, capacity)
        assert err.value.status_code == 400 and "shorten the prompt or lower max_tokens" in err.value.detail


def test_a_valid_chat_and_completion_pass_and_keep_extra_fields():
    check_request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1,
                   "chat_template_kwargs": {}}, ChatRequest)
    check_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, ChatRequest)
    check_request({"prompt": "hi", "max_tokens": 1, "stream": True}, CompletionRequest)


def test_the_error_names_every_bad_field_and_leaves_out_the_values():
    with pytest.raises(HTTPException) as err:
        check_request({"messages": [], "max_tokens": -5, "temperature": "hot"}, ChatRequest)
    assert err.value.status_code == 422
    assert {error["loc"][0] for error in err.value.detail} == {"messages", "max_tokens", "temperature"}
    assert all("input" not in error for error in err.value.detail)


@pytest.mark.parametrize("field, value", [
    ("previous_response_id", "resp_1"), ("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"}),
    ("text", {"format": {"type": "json_object"}}), ("text", {"verbosity": "low"}), ("top_logprobs", 2),
    ("include", ["message.output_text.logprobs"]), ("background", True), ("tool_choice", "required"),
    ("max_tool_calls", 1), ("reasoning", {"effort": "high"})])
def test_a_responses_field_the_engine_would_not_apply_is_refused_naming_it(field, value):
    """Hugging Face's responses handler logged these once and answered as if they were absent
    (``previous_response_id``: without the earlier turns)."""
    with pytest.raises(HTTPException) as err:
        check_honoured({"input": "hi", field: value}, True, ResponseRequest)
    assert err.value.status_code == 400 and f"'{field}'" in err.value.detail


@pytest.mark.parametrize("body", [{"text": {"format": {"type": "text"}}}, {"include": []}, {"background": False},
                                  {"tool_choice": "auto"}, {"top_logprobs": 0}, {"store": False, "user": "u",
                                                                                 "metadata": {"a": "b"}}])
def test_neutral_responses_values_pass(body):
    assert ignored_fields({"input": "hi", **body}, False, ResponseRequest) == []


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f", "parameters": {}}]), ("tool_choice", "none"),
                                          ("function_call", {"name": "f"}), ("modalities", ["text", "audio"]),
                                          ("web_search_options", {}), ("reasoning_effort", "low")])
def test_a_chat_field_the_engine_would_not_apply_is_refused_naming_it(field, value):
    with pytest.raises(HTTPException) as err:
        check_honoured({"messages": [{"role": "user", "content": "hi"}], field: value}, True, ChatRequest)
    assert err.value.status_code == 400 and f"'{field}'" in err.value.detail


@pytest.mark.parametrize("schema", [ChatRequest, CompletionRequest, ResponseRequest])
def test_generation_config_may_name_only_what_the_engine_applies(schema):
    """The handlers merge any key of ``generation_config`` (JSON); the engine applies only
    :data:`ENGINE_GENERATION_KEYS`: ``num_beams`` was dropped without a word."""
    applied = json.dumps({name: 1 for name in sorted(ENGINE_GENERATION_KEYS)})
    assert ignored_fields({"generation_config": applied}, True, schema) == []
    for text, words in [('{"num_beams": 4, "top_k": 3}', "'num_beams'"), ('{"repetition_penalty": 1.2}',
                                                                          "'repetition_penalty'"),
                        ("[1, 2]", "JSON object"), ("{nope", "not JSON")]:
        problems = ignored_fields({"generation_config": text}, True, schema)
        assert len(problems) == 1 and words in problems[0] and "top_k" not in problems[0].split(";")[0], problems


def test_top_p_counts_a_generation_config_that_samples():
    sampling = json.dumps({"do_sample": True, "temperature": 0.8})
    assert ignored_fields({"top_p": 0.5, "generation_config": sampling}, False, ResponseRequest) == []
    greedy = json.dumps({"do_sample": False})
    assert [p.split(":")[0] for p in ignored_fields({"top_p": 0.5, "generation_config": greedy}, True,
                                                     ResponseRequest)] == ["'top_p'"]
    assert ignored_fields({"top_p": 0.5, "temperature": 0.3, "generation_config": greedy}, False,
                          ResponseRequest) == []  # the request's temperature decides, as Hugging Face applies it last


def test_a_response_request_checks_its_input_and_token_count():
    check_request({"input": "hi", "max_output_tokens": 3, "instructions": "be brief"}, ResponseRequest)
    check_request({"input": [{"role": "user", "content": "hi"}]}, ResponseRequest)
    with pytest.raises(HTTPException) as err:
        check_request({"input": "", "max_output_tokens": 0, "temperature": 3}, ResponseRequest)
    assert {error["loc"][0] for error in err.value.detail} == {"input", "max_output_tokens", "temperature"}
