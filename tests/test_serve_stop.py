"""Stop strings and ignored-field refusals of ``specontext serve`` without a server: the stream
filter against ``text[:first stop]`` for any split of the text into chunks (hypothesis), the
non-streaming path through a fake engine client, and the fields a greedy engine refuses."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import HTTPException
from hypothesis import given, settings
from hypothesis import strategies as st

from specontext_compile.serve_checks import check_honoured, ignored_fields
from specontext_compile.serve_stop import ServedEngine, StopFilter, first_stop, held_back

ALPHABET = "ab\n."


class _Streamer:
    """Hugging Face's Detokenizer as the filter uses it: tokens in, text to a queue, cancel."""

    def __init__(self, queue):
        self.queue, self.cancelled, self.total_tokens = queue, 0, 0

    def put_token(self, token: int) -> None:
        self.total_tokens += 1
        self.queue.put_nowait(ALPHABET[token])

    def cancel(self) -> None:
        self.cancelled += 1


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


async def _read_all(stream) -> list:
    """As Hugging Face's handlers read a stream: wait for one item, take what is there, until None."""
    items = []
    while True:
        batch = [await stream.get()]
        while not stream.empty():
            batch.append(stream.get_nowait())
        items.extend(batch)
        if None in batch:
            return items[:items.index(None)]


@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=12),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3))
def test_a_stream_is_the_text_before_the_first_stop_for_any_chunking(text, cuts, stops):
    async def run():
        queue = asyncio.Queue()
        for chunk in _split(text, cuts):
            queue.put_nowait(chunk)
        queue.put_nowait(None)
        streamer = _Streamer(queue)
        got = await _read_all(StopFilter(queue, streamer, tuple(stops)))
        return got, streamer.cancelled

    got, cancelled = asyncio.run(run())
    cut = first_stop(text, tuple(stops))
    assert "".join(got) == (text if cut is None else text[:cut])
    assert cancelled == (cut is not None)
    assert all(isinstance(part, str) and part for part in got)


def test_the_stop_completed_first_ends_the_answer():
    assert first_stop(".aaa", ("a", ".aa")) == 1  # "a" is complete before ".aa"
    assert first_stop("xab", ("ab", "xab")) == 0  # both end together: the longer
    assert first_stop("abc", ("d",)) is None


def test_held_back_is_the_longest_end_that_begins_a_stop():
    assert held_back("the en", ("end",)) == 2
    assert held_back("the e", ("end", "e.")) == 1
    assert held_back("abc", ("x",)) == 0
    assert held_back("", ("ab",)) == 0


def test_items_other_than_answer_text_pass_through_unfiltered():
    class Reasoning(str):
        pass

    async def run():
        queue = asyncio.Queue()
        for item in (Reasoning("think. stop"), "ans", "wer. stop", "never sent", None):
            queue.put_nowait(item)
        return await _read_all(StopFilter(queue, _Streamer(queue), ("stop",)))

    got = asyncio.run(run())
    assert got[0] == "think. stop" and type(got[0]) is Reasoning
    assert "".join(got[1:]) == "answer. " and all(type(part) is str for part in got[1:])


class _Engine:
    """Hugging Face's EngineClient as ServedEngine uses it: tokens of ``answer`` streamed."""

    model_id = "/some/resolved/path:model.gguf"

    def __init__(self, answer: str):
        self.answer, self.kwargs = answer, None

    def generate_streaming(self, inputs, generation_kwargs, *args, **kwargs):
        self.kwargs = dict(generation_kwargs)
        queue = asyncio.Queue()
        streamer = _Streamer(queue)

        async def produce():
            for ch in self.answer:
                await asyncio.sleep(0)
                if streamer.cancelled:
                    break
                streamer.put_token(ALPHABET.index(ch))
            queue.put_nowait(None)

        self.task = asyncio.get_running_loop().create_task(produce())
        return queue, streamer

    async def generate_non_streaming(self, inputs, generation_kwargs):
        self.kwargs = dict(generation_kwargs)
        return self.answer, len(inputs["input_ids"]), [ALPHABET.index(ch) for ch in self.answer]


def test_non_streaming_stops_generating_at_the_stop_and_counts_its_tokens():
    async def run():
        engine = _Engine("ab.ab\nbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb")
        served = ServedEngine(engine, "smollm2-135m")
        text, prompt, tokens = await served.generate_non_streaming({"input_ids": [1, 2, 3]},
                                                                   {"stop_strings": ["\n", "zz"], "max_new_tokens": 9})
        await engine.task
        return engine, served, text, prompt, tokens

    engine, served, text, prompt, tokens = asyncio.run(run())
    assert (text, prompt) == ("ab.ab", 3)
    assert tokens == [ALPHABET.index(ch) for ch in "ab.ab\n"]  # the token that completed the stop, no more
    assert "stop_strings" not in engine.kwargs  # taken out: the engine would drop them anyway
    assert served.model_id == "smollm2-135m"


def test_without_stop_strings_the_engine_answers_unchanged():
    async def run():
        engine = _Engine("ab\nab")
        return await ServedEngine(engine, "m").generate_non_streaming({"input_ids": [1]}, {"stop_strings": None})

    assert asyncio.run(run()) == ("ab\nab", 1, [0, 1, 2, 0, 1])


@pytest.mark.parametrize("field, value", [("n", 2), ("logprobs", True), ("logprobs", 3), ("top_logprobs", 2),
                                          ("logit_bias", {"50": -100}), ("frequency_penalty", 0.5),
                                          ("presence_penalty", -1), ("best_of", 3), ("echo", True),
                                          ("response_format", {"type": "json_object"})])
def test_a_field_the_engine_would_not_apply_is_refused_naming_it(field, value):
    with pytest.raises(HTTPException) as err:
        check_honoured({"prompt": "hi", field: value}, samples=True)
    assert err.value.status_code == 400 and f"'{field}'" in err.value.detail


@pytest.mark.parametrize("body", [{"n": 1}, {"logprobs": False}, {"logprobs": 0}, {"logit_bias": {}},
                                  {"frequency_penalty": 0}, {"response_format": {"type": "text"}}, {"echo": False},
                                  {"temperature": 0}, {"top_p": 1}, {"n": None, "stop": ["x"], "seed": 3}])
def test_neutral_values_pass(body):
    assert ignored_fields(body, samples=False) == []


def test_top_p_is_refused_only_on_a_request_that_does_not_sample():
    assert ignored_fields({"temperature": 0.7, "top_p": 0.9}, samples=False) == []  # the request samples
    assert ignored_fields({"temperature": 1.5}, samples=False) == []
    assert [p.split(":")[0] for p in ignored_fields({"top_p": 0.9}, samples=False)] == ["'top_p'"]
    assert [p.split(":")[0] for p in ignored_fields({"temperature": 0, "top_p": 0.9}, samples=True)] == ["'top_p'"]
    assert ignored_fields({"top_p": 0.9}, samples=True) == []  # no temperature: the model's config samples


def test_a_greedy_generation_config_is_made_to_sample_per_request():
    """The engine builds a per-request temperature, top-k and top-p processor only from
    non-neutral values of the model's config (Hugging Face's ``_get_logits_processor``)."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessorList)
    from transformers import LlamaConfig, LlamaForCausalLM

    from specontext_compile.serve_engine import sample_per_request

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    greedy = GenerationConfig()
    assert ContinuousBatchingLogitsProcessorList(model._get_logits_processor(greedy),
                                                 per_request_processors=True).supported_keys == {}
    sample_per_request(greedy)
    keys = ContinuousBatchingLogitsProcessorList(model._get_logits_processor(greedy),
                                                 per_request_processors=True).supported_keys
    assert greedy.do_sample and set(keys) == {"temperature", "top_k", "top_p"}
    sampling = GenerationConfig(do_sample=True, temperature=0.3, top_k=5, top_p=0.5)
    sample_per_request(sampling)
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.3, 5, 0.5)  # left as it is
