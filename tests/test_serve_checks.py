"""The request checks of ``specontext serve`` without a server: the capacity rule (a request
needs its prompt plus at least one new token of KV cache) and the value schema."""

from __future__ import annotations

import pytest
from fastapi import HTTPException
from hypothesis import given
from hypothesis import strategies as st

from specontext_compile.serve_checks import ChatRequest, CompletionRequest, check_capacity, check_request


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
