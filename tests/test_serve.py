"""``specontext serve`` (issue 28, item 3): Hugging Face's OpenAI-compatible server with our
continuous-batching step, on SmolLM2-135M over localhost. Concurrent chat completions (one
streamed, through the ``openai`` client) are checked against dense greedy decoding of the
same chat; bad requests get clear error responses while the server keeps serving; the
server shuts down cleanly."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import multiprocessing.connection
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from specontext_compile.serve import build_server

pytestmark = pytest.mark.xdist_group("test_serve")  # its module fixture is built once: one worker runs the module (--dist loadgroup)

NEW = 10
QUESTIONS = ("What is the capital of France?", "Name three colors.", "Write one word about the sea.")
# a budget covering every request's context: the sparse step must give dense's tokens
OPTIONS = {"budget": 512, "sink_tokens": 4, "recent_window": 16, "page_rescue": 0}
ENGINE = dict(num_blocks=16, page_size=32, max_batch_tokens=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start():
    """A started server on a free port and its URL, once ``/health`` answers."""
    port = _free_port()
    srv = build_server("smollm2-135m", OPTIONS, port=port, engine=ENGINE)
    srv.start()
    url = f"http://localhost:{port}"
    _wait_healthy(url, 30.0)
    return srv, url


def _wait_healthy(url: str, seconds: float, alive=lambda: True) -> None:
    """Until ``/health`` answers (at most ``seconds``); ``alive()`` False fails at once."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5)
            return
        except OSError:
            assert alive(), "the server exited before answering /health"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server():
    srv, url = _start()
    yield srv, url
    srv.stop()


def _post(url: str, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _chat(srv, content: str, **extra) -> dict:
    return {"model": srv.model_id, "messages": [{"role": "user", "content": content}], "max_tokens": NEW,
            "temperature": 0, **extra}


def _dense_answers(srv) -> list[str]:
    """Dense greedy decoding of each chat by ``model.generate`` (HF eager, SDPA), decoded as the
    server decodes (special tokens skipped)."""
    from specontext_compile.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    answers = []
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


def _stream(url: str, srv, question: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    chunks = client.chat.completions.create(**_chat(srv, question), stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def test_concurrent_chats_one_streamed_give_dense_text_through_the_sparse_step(server):
    srv, url = server
    before = srv.path_counts()  # read in the model's process
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        streamed = pool.submit(_stream, url, srv, QUESTIONS[0])
        plain = [pool.submit(_post, url, _chat(srv, q)) for q in QUESTIONS[1:]]
        answers = [streamed.result()]
        for future in plain:
            status, body = future.result()
            assert status == 200, body
            answers.append(body["choices"][0]["message"]["content"])
    assert answers == _dense_answers(srv)
    after = srv.path_counts()
    assert after["sparse_steps"] > before["sparse_steps"]  # the gather path ran, not a dense shortcut
    assert after["sparse_sites"] - before["sparse_sites"] >= 30 * (after["sparse_steps"] - before["sparse_steps"])
    with urllib.request.urlopen(f"{url}/specontext/path_counts", timeout=60) as response:
        served = json.loads(response.read())  # what a user reads over HTTP: the same counters
    assert served == srv.path_counts() and served["sparse_steps"] == after["sparse_steps"]


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server):
    srv, url = server
    status, body = _post(url, _chat(srv, "hi", budget_tokens=3))
    assert status == 422 and "budget_tokens" in json.dumps(body)  # unknown option: named
    capacity = srv.capacity
    assert capacity == 16 * 32
    status, body = _post(url, _chat(srv, "hello " * capacity))
    assert status == 400 and "shorten the prompt or lower max_tokens" in body["detail"]
    status, body = _post(url, _chat(srv, "x", max_tokens=capacity))  # short prompt, too many new tokens
    assert status == 400 and f"{capacity} tokens" in body["detail"]
    status, body = _post(url, _chat(srv, QUESTIONS[0]))  # still serving
    assert status == 200 and body["choices"][0]["message"]["content"]
    assert srv.alive


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("max_tokens", -1), ("max_tokens", "abc"),
                                          ("max_completion_tokens", 0), ("temperature", -1), ("top_p", 0),
                                          ("messages", []), ("messages", [{"content": "no role"}]),
                                          ("messages", "hi"), ("stream", "sometimes")])
def test_bad_values_get_422_naming_the_field(server, field, value):
    srv, url = server
    status, body = _post(url, {**_chat(srv, "hi"), field: value})
    assert status == 422, body
    assert any(error["loc"][0] == field for error in body["detail"]), body


def test_a_negative_max_tokens_cannot_pass_the_capacity_check(server):
    """A prompt over capacity with ``max_tokens`` -100 passed ``prompt + new <= capacity``,
    failed Hugging Face's scheduler and killed the engine (every later request: 503)."""
    srv, url = server
    status, body = _post(url, _chat(srv, "hello " * srv.capacity, max_tokens=-100))
    assert status == 422 and body["detail"][0]["loc"] == ["max_tokens"]
    status, body = _post(url, _chat(srv, QUESTIONS[1], max_tokens=2))
    assert status == 200 and srv.alive


def test_the_model_is_named_by_its_short_name_or_left_out(server):
    srv, url = server
    for body in ({**_chat(srv, "Say hi.", max_tokens=2), "model": "smollm2-135m"},
                 {key: value for key, value in _chat(srv, "Say hi.", max_tokens=2).items() if key != "model"}):
        status, answer = _post(url, body)
        assert status == 200, answer
    status, answer = _post(url, {**_chat(srv, "Say hi.", max_tokens=2), "model": "gpt-4"})
    assert status == 400 and "name it 'smollm2-135m'" in answer["detail"] and "gpt-4" in answer["detail"]


def test_a_stream_ends_with_done(server):
    srv, url = server
    request = urllib.request.Request(f"{url}/v1/chat/completions",
                                     data=json.dumps(_chat(srv, "Say hi.", max_tokens=3, stream=True)).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert all(json.loads(event[6:])["object"] == "chat.completion.chunk" for event in events[:-1])


def test_stop_strings_end_the_answer_streamed_or_not(server):
    """Hugging Face's engine dropped ``stop`` (the answer ran to max_tokens). Now the answer is
    the greedy answer cut before the stop string, with finish_reason "stop", fewer tokens,
    the same streamed and not, and the response names the model as the server was started."""
    from openai import OpenAI

    srv, url = server
    question = "Write a short poem about the sea."
    status, full = _post(url, _chat(srv, question, max_tokens=NEW))
    assert status == 200 and full["model"] == "smollm2-135m"
    answer = full["choices"][0]["message"]["content"]
    stop = answer.split()[2]  # a word inside the greedy answer
    assert len(answer) > answer.find(stop) > 0
    status, cut = _post(url, _chat(srv, question, max_tokens=NEW, stop=[stop, "never in it"]))
    assert status == 200, cut
    assert cut["choices"][0]["message"]["content"] == answer[:answer.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] < NEW
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(**_chat(srv, question, max_tokens=NEW, stop=stop), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer[:answer.find(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert {c.model for c in chunks} == {"smollm2-135m"}
    completion = client.completions.create(model="smollm2-135m", prompt="The sea is", max_tokens=NEW, temperature=0)
    text = completion.choices[0].text
    stop = text.split()[1]
    cut = client.completions.create(model="smollm2-135m", prompt="The sea is", max_tokens=NEW, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_a_request_with_a_temperature_samples_and_one_without_stays_greedy(server):
    """``temperature`` 1.5 gave the greedy text (SmolLM2's generation config does not sample,
    and Hugging Face's engine then applies no request's temperature). Now it samples: two
    seeds give two texts, neither the greedy one; the greedy answer is unchanged."""
    srv, url = server
    question = "Write a short poem about the sea."
    greedy = [_post(url, _chat(srv, question, max_tokens=NEW))[1]["choices"][0]["message"]["content"]
              for _ in range(2)]
    assert greedy[0] == greedy[1]
    sampled = []
    for seed in (1, 2):
        status, body = _post(url, _chat(srv, question, max_tokens=NEW, temperature=1.5, seed=seed))
        assert status == 200, body
        sampled.append(body["choices"][0]["message"]["content"])
    assert greedy[0] not in sampled and sampled[0] != sampled[1], (greedy, sampled)
    status, body = _post(url, {key: value for key, value in _chat(srv, question, max_tokens=NEW).items()
                               if key != "temperature"})
    assert body["choices"][0]["message"]["content"] == greedy[0]  # no temperature: the model's greedy config


@pytest.mark.parametrize("field, value", [("n", 2), ("logprobs", True), ("response_format", {"type": "json_object"}),
                                          ("top_p", 0.5)])
def test_fields_the_engine_would_ignore_are_refused_naming_them(server, field, value):
    """They were answered as if absent (``top_p`` here: on a request at temperature 0)."""
    srv, url = server
    status, body = _post(url, {**_chat(srv, "hi"), field: value})
    assert status == 400 and f"'{field}'" in body["detail"], body


def _respond(srv, content: str, **extra) -> dict:
    return {"model": srv.model_name, "input": content, "max_output_tokens": NEW, "temperature": 0, **extra}


def _output_text(body: dict) -> str:
    return "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])


def test_responses_answer_as_chat_does_under_the_started_name_streamed_or_not(server):
    """``/v1/responses`` renders the same chat as ``/v1/chat/completions``: the same greedy text."""
    from openai import OpenAI

    srv, url = server
    question = QUESTIONS[1]
    chat = _post(url, _chat(srv, question))[1]["choices"][0]["message"]["content"]
    status, body = _post(url, _respond(srv, question), "/v1/responses")
    assert status == 200, body
    assert _output_text(body) == chat and body["model"] == srv.model_name, body
    events = OpenAI(base_url=f"{url}/v1", api_key="unused").responses.create(**_respond(srv, question), stream=True)
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == chat


def test_a_responses_request_with_a_temperature_samples(server):
    """As for chat (Hugging Face's shared handler kept the greedy config: temperature 1.5 gave
    the greedy text): two seeds, two texts, neither the greedy one."""
    srv, url = server
    question = "Write a short poem about the sea."
    greedy = _output_text(_post(url, _respond(srv, question), "/v1/responses")[1])
    sampled = [_output_text(_post(url, _respond(srv, question, temperature=1.5, seed=seed), "/v1/responses")[1])
               for seed in (1, 2)]
    assert greedy not in sampled and sampled[0] != sampled[1], (greedy, sampled)


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/responses", {"previous_response_id": "resp_1"}, 400, "'previous_response_id'"),
    ("/v1/responses", {"text": {"format": {"type": "json_object"}}}, 400, "'text'"),
    ("/v1/responses", {"input": ""}, 422, "input"),
    ("/v1/responses", {"max_output_tokens": 0}, 422, "max_output_tokens"),
    ("/v1/responses", {"generation_config": '{"num_beams": 2}'}, 400, "'num_beams'"),
    ("/v1/chat/completions", {"generation_config": '{"repetition_penalty": 1.3}'}, 400, "'repetition_penalty'"),
    ("/v1/chat/completions", {"tool_choice": "none"}, 400, "'tool_choice'")])
def test_what_the_engine_would_not_apply_is_refused_on_every_endpoint(server, path, body, status, words):
    srv, url = server
    base = _respond(srv, "hi") if path == "/v1/responses" else _chat(srv, "hi")
    code, answer = _post(url, {**base, **body}, path)
    assert code == status and words in json.dumps(answer), answer


def test_text_completions_check_their_prompt(server):
    srv, url = server
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(
        {"model": srv.model_name, "prompt": "", "max_tokens": 2}).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=600)
    assert err.value.code == 422 and "prompt" in err.value.read().decode()


def test_bad_options_fail_before_the_model_loads():
    with pytest.raises(ValueError, match="budget"):
        build_server("smollm2-135m", {"budget": 0})
    with pytest.raises(ValueError, match="does not build"):
        build_server("smollm2-135m", {"candidates": 4.0, "min_coverage": 0.9})


@pytest.mark.parametrize("version", ["5.0.0", "5.24.0", "5.24.1.dev0"])
def test_a_transformers_without_a_process_per_model_is_refused_naming_the_fix(version):
    from specontext_compile.serve import _check_transformers_version

    with pytest.raises(ImportError, match=r"pip install 'transformers>=5.25,<6'"):
        _check_transformers_version(version)


def test_the_installed_transformers_is_one_serve_assembles():
    import transformers

    from specontext_compile.serve import _check_transformers_version

    _check_transformers_version(transformers.__version__)  # the test extra pins it
    _check_transformers_version("5.25.0")


def test_the_model_process_refuses_to_serve_without_the_backend(monkeypatch):
    """In the model's process (another pid than the API server's), a generation state whose
    loader made no configuration raises instead of letting Hugging Face's runner fall back to
    its default, dense configuration; in the API server the same question tokenizes for
    continuous batching."""
    from transformers import AutoConfig

    from specontext_compile.serve_engine import SpeContextGenerationState, SpeContextLoader

    state = SpeContextGenerationState(SpeContextLoader({}, {}, device="cpu", dtype="float32"))
    config = AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"])
    assert state.use_continuous_batching(config, None) and state.cb_config is None  # the API server
    with pytest.raises(ValueError, match="serves text models"):  # e.g. a speech model: no text runner
        state.use_continuous_batching(AutoConfig.for_model("llama"), None)
    monkeypatch.setattr(state, "server_pid", -1)  # as in the model's process
    with pytest.raises(RuntimeError, match="refusing to serve it dense"):
        state.use_continuous_batching(config, None)
    with pytest.raises(ValueError, match="makes the continuous-batching configuration itself"):
        state.cb_config = object()


def _stream_events(url: str, srv, first_chunk: threading.Event) -> list[str]:
    """A long streamed chat's raw events (``data: ...``), read as they come; sets
    ``first_chunk`` once an answer token has arrived."""
    request = urllib.request.Request(f"{url}/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps(_chat(srv, "Tell a long story.", max_tokens=400,
                                                           stream=True)).encode())
    events = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.strip():
                events.append(line.decode().strip())
                if '"content"' in events[-1]:
                    first_chunk.set()
    return events


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.slow  # its own server start (about 64 s); the drain's semantics are tests/test_serve_drain.py's, fast
def test_the_server_shuts_down_cleanly():
    """stop() with a stream and a plain request in flight: each gets an error naming the stop
    after the grace (the stream an error event and [DONE], the plain one a 503), nothing is
    logged as an ASGI exception, and the model's process and the port go."""
    srv, url = _start()
    uvicorn_log = _Records()  # uvicorn's logger does not propagate to the root (caplog)
    logging.getLogger("uvicorn.error").addHandler(uvicorn_log)
    status, _ = _post(url, _chat(srv, "Say hi.", max_tokens=3))
    assert status == 200
    engine = srv.model_manager.get_engine(None)  # Hugging Face's EngineClient of the model's process
    process = engine.managed_process
    assert process.is_alive()
    first_chunk = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_stream_events, url, srv, first_chunk)
        plain = pool.submit(_post, url, _chat(srv, "Tell another long story.", max_tokens=400))
        assert first_chunk.wait(300), "the stream sent no answer token"
        srv.stop(grace=0.5)
        events, (status, body) = streamed.result(60), plain.result(60)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "server_stopping"
    assert status == 503 and "server stopped" in body["error"]["message"]
    logging.getLogger("uvicorn.error").removeHandler(uvicorn_log)
    assert not [m for m in uvicorn_log.messages if "Exception in ASGI application" in m or "graceful shutdown" in m]
    # stop() returns once the model's process has ended: its sentinel is ready at once. (Not
    # Process.is_alive(): Hugging Face's thread reaps the process, and a second thread's waitpid
    # then gets ECHILD, which multiprocessing reads as alive; CI once saw that.)
    assert multiprocessing.connection.wait([process.sentinel], 0), "stop() returned before the model's process ended"
    assert not srv._thread.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)


def test_the_command_line_refuses_bad_options_with_exit_2(capsys):
    from specontext_compile.cli import main

    assert main(["serve", "--options", "[1]"]) == 2
    assert "--options must be a JSON object" in capsys.readouterr().err
    assert main(["serve", "--options", "not json"]) == 2
    assert "--options must be a JSON object" in capsys.readouterr().err


def test_the_module_entry_point_runs_nothing_when_a_spawned_process_imports_it():
    """The model's process is spawned: it imports the parent's main module as ``__mp_main__``.
    ``python -m specontext_compile serve`` must not start a second command line there."""
    import runpy

    runpy.run_module("specontext_compile.__main__", run_name="__mp_main__")  # no SystemExit, no CLI run


def test_the_step_raises_the_recompile_limit_in_the_thread_that_compiles():
    """torch's config overrides are thread-local and Hugging Face's engine compiles in a thread
    of its own: a limit raised by the server's thread left the engine's at 8, and the ninth
    padded query size ran eagerly, without the backend. The backend raises it as it compiles."""
    import threading

    from specontext_compile.models import load_model
    from specontext_compile.serving import continuous_batching_config

    model, _ = load_model("smollm2-135m")
    config = continuous_batching_config(model, OPTIONS, num_blocks=16, page_size=32, max_batch_tokens=512,
                                        q_padding_interval_size=8)
    backend = config.varlen_compile_config.backend
    limits = {}

    def engine_thread():
        limits["before"] = torch._dynamo.config.recompile_limit
        compiled = backend(torch.fx.symbolic_trace(torch.nn.Identity()), [torch.zeros(2)])  # not a CB step: dense
        limits["output"] = compiled(torch.ones(2))
        limits["after"] = torch._dynamo.config.recompile_limit

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    output = limits.pop("output")
    assert limits == {"before": 8, "after": 512 // 8 + 2}
    assert torch.equal(output[0] if isinstance(output, (tuple, list)) else output, torch.ones(2))
    assert torch._dynamo.config.recompile_limit == 8  # this thread's own setting is untouched


@pytest.mark.slow
def test_ctrl_c_on_the_command_line_exits_without_leaks_or_tracebacks(tmp_path):
    """``specontext serve`` as a user runs it: one request, then Ctrl-C, which a terminal sends
    to the whole process group (the server, the model's process, multiprocessing's resource
    tracker). Exit status 0, every process gone, and nothing on stderr but what the server
    printed: no "leaked semaphore" warning (the model's process used to die on SIGTERM
    without running its finalizers), no traceback, no nanobind leak report (an interpreter
    shutdown of the model's process after triton was imported)."""
    import os
    import signal
    import subprocess
    import sys

    port = _free_port()
    errors = tmp_path / "stderr.txt"
    with open(errors, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "specontext_compile", "serve", "--port", str(port),
                                 "--budget", "512", "--num-blocks", "16", "--page-size", "32",
                                 "--max-batch-tokens", "128"],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        url = f"http://localhost:{port}"
        _wait_healthy(url, 300.0, alive=lambda: proc.poll() is None)
        status, body = _post(url, {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
        assert status == 200, body
        group = os.getpgid(proc.pid)
        members = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split()
        assert len(members) >= 2  # the server and the model's process at least
        os.killpg(group, signal.SIGINT)
        assert proc.wait(120) == 0
        for _ in range(100):  # the model's process and the tracker end with the server
            if not subprocess.run(["pgrep", "-g", str(group)], capture_output=True).stdout:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("processes of the server's group still running after its exit")
    finally:
        if proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
    text = errors.read_text()
    for word in ("leaked semaphore", "Traceback", "nanobind", "leaked"):
        assert word not in text, text[-3000:]
