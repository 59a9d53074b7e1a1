"""Far-context teacher-forced tasks on ``pydoc_data.topics`` text (shared by every venv).

Only torch, the standard library and a tokenizer object passed in: importable from ``.venv``
(our compile backend) and from ``.venv-kvpress`` (the kvpress peer,
:mod:`benchmarks.kvpress_peer`), so both measure the same tokens.

Two kinds of task, each a triple of int64 token tensors ``(context, question, continuation)``:

* ``copy`` (needs the *far* context): ``context`` = the first ``N`` tokens of the text
  (``N = context_budget - reserve``, the same ``N`` for every depth); ``question`` = a fixed
  instruction (``"\\n\\nRepeat the following passage from the document above word for word:"``)
  followed by the first ``words`` words of a passage that starts at depth ``d`` of the context
  (their token ids are *copied* from the context, so the boundary is exact); ``continuation`` =
  the ``steps + 1`` context tokens that follow those words. The passage prefix occurs exactly
  once in the context.
* ``plain`` (reference): ``context`` = the same first ``N`` tokens, no question,
  ``continuation`` = the next ``steps + 1`` tokens of the text. This is our fidelity protocol
  (:mod:`benchmarks.fidelity_decode`) at ``context = N``.

Teacher forcing, the same for every method and setting: decode step ``i`` (``0 <= i < steps``)
feeds ``continuation[i]`` and is scored on predicting ``continuation[i + 1]``. The first
continuation token is predicted by the prompt itself and is not scored (it is the token a
prefill-time method cannot affect). Two ways to place the question:

* setting ``A`` (question inside the compressed prompt): prompt = context + question, then
  the ``steps`` decode steps;
* setting ``B`` (question after compression, kvpress's pipeline default): prompt = context
  only; then question + ``continuation[:steps]`` are fed (teacher forced), and only the
  ``steps`` positions whose targets are ``continuation[1:]`` are scored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pydoc_data.topics

import torch

__all__ = [
    "QUESTION",
    "FarContextTask",
    "build_tasks",
    "decode_inputs",
    "pydoc_text",
    "text_ids",
    "token_hash",
]

QUESTION = "\n\nRepeat the following passage from the document above word for word:"
DEPTHS = (0.1, 0.5, 0.9)


def pydoc_text() -> str:
    """The English text every fidelity benchmark uses (as :mod:`benchmarks.fidelity`)."""
    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def text_ids(tokenizer) -> torch.Tensor:
    """int64 ``[tokens]`` of :func:`pydoc_text`, without special tokens: the ids
    :mod:`benchmarks.fidelity` gets from ``tokenizer(text)`` in ``.venv`` (transformers 5.x adds
    no BOS for this GGUF tokenizer there, but transformers 5.2 in ``.venv-kvpress`` would), so
    both venvs see the same tokens."""
    return torch.as_tensor(tokenizer(pydoc_text(), add_special_tokens=False).input_ids, dtype=torch.long)


def token_hash(ids: torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of the int64 little-endian bytes of ``ids`` (flattened)."""
    data = ids.detach().to("cpu", torch.long).contiguous().view(-1).numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


@dataclasses.dataclass
class FarContextTask:
    """One teacher-forced task (see the module docstring).

    Attributes:
        kind: ``"copy"`` or ``"plain"``.
        context: int64 ``[N]``; the same tokens for every task of one :func:`build_tasks` call.
        question: int64 ``[Q]`` (empty for ``plain``): the instruction then the passage prefix.
        continuation: int64 ``[steps + 1]``.
        depth: requested depth (``None`` for plain); ``passage_start / N`` is the actual one.
        passage_start: index in ``context`` of the passage's first word (the question's
            prefix is ``context[passage_start:continuation_start]``); ``N`` for plain.
        continuation_start: index in ``context`` (copy) / the text (plain) of
            ``continuation[0]``.
    """

    kind: str
    context: torch.Tensor
    question: torch.Tensor
    continuation: torch.Tensor
    depth: float | None
    passage_start: int
    continuation_start: int

    @property
    def name(self) -> str:
        return "plain" if self.kind == "plain" else f"copy@{self.depth:g}"

    @property
    def steps(self) -> int:
        return int(self.continuation.numel()) - 1

    @property
    def distance(self) -> int:
        """Tokens between the copied passage and the end of the context (copy), 0 for plain."""
        return int(self.context.numel()) - self.continuation_start if self.kind == "copy" else 0

    def describe(self) -> dict:
        """JSON-able summary: sizes, positions and the token ids' hashes."""
        n = int(self.context.numel())
        return {
            "name": self.name, "kind": self.kind, "depth": self.depth,
            "actual_depth": round(self.passage_start / n, 4) if self.kind == "copy" else None,
            "context_tokens": n, "question_tokens": int(self.question.numel()), "steps": self.steps,
            "passage_start": self.passage_start, "continuation_start": self.continuation_start,
            "distance_to_context_end": self.distance,
            "hash_context": token_hash(self.context), "hash_question": token_hash(self.question),
            "hash_continuation": token_hash(self.continuation),
        }


def _word_starts(tokenizer, ids: list[int]) -> list[bool]:
    """Whether each token begins a word: its text starts with a space followed by a letter or
    digit (the GPT-2/BPE convention; a token after a newline does not count, so passages start
    inside running text)."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    out = []
    for tid, piece in zip(ids, pieces):
        if piece and piece[0] in ("\u0120", "\u2581"):  # 'Ġ' (GPT-2 BPE), '▁' (SentencePiece)
            out.append(len(piece) > 1 and piece[1].isalnum())
        else:
            text = tokenizer.decode([tid])
            out.append(len(text) > 1 and text[0] == " " and text[1].isalnum())
    return out


def _occurrences(hay: list[int], needle: list[int]) -> int:
    k, first, count = len(needle), needle[0], 0
    for i in range(len(hay) - k + 1):
        if hay[i] == first and hay[i : i + k] == needle:
            count += 1
    return count


def build_tasks(
    tokenizer,
    context: int,
    steps: int,
    depths: tuple[float, ...] = DEPTHS,
    words: int = 12,
    reserve: int = 64,
    ids: torch.Tensor | None = None,
) -> list[FarContextTask]:
    """The ``plain`` task and one ``copy`` task per depth, all on the same context tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (``__call__``, ``convert_ids_to_tokens``,
            ``decode``).
        context: prompt budget; the context part is ``N = context - reserve`` tokens so that
            context + question fits in ``context``.
        steps: scored teacher-forced steps (``continuation`` has ``steps + 1`` tokens).
        depths: where the copied passages start, as fractions of ``N`` (clamped so that the
            passage and its continuation lie inside the context).
        words: words of the passage given in the question.
        reserve: tokens kept free for the question (raises if a question is longer).
        ids: the text's token ids (default :func:`text_ids`).

    Raises:
        ValueError: the text is too short, or no unique passage prefix / question too long.
    """
    ids = text_ids(tokenizer) if ids is None else ids.to(torch.long).view(-1)
    n = context - reserve
    if n <= 0 or ids.numel() < n + steps + 1:
        raise ValueError(f"need {n + steps + 1} tokens of text for context {context}, have {ids.numel()}")
    ctx = ids[:n].clone()
    tasks = [FarContextTask("plain", ctx, torch.zeros(0, dtype=torch.long), ids[n : n + steps + 1].clone(),
                            None, n, n)]
    template = torch.as_tensor(tokenizer(QUESTION, add_special_tokens=False).input_ids, dtype=torch.long)
    ctx_list = ctx.tolist()
    starts = _word_starts(tokenizer, ctx_list)
    for depth in depths:
        p = int(depth * n)
        task = None
        while p < n:
            if not starts[p]:
                p += 1
                continue
            # the passage prefix: `words` word starts from p; the continuation begins at the next one
            q, seen = p, 0
            while q < n and (seen < words or not starts[q]):
                seen += starts[q]
                q += 1
            if q + steps + 1 > n:
                break
            prefix = ctx_list[p:q]
            if _occurrences(ctx_list, prefix) == 1:
                task = FarContextTask("copy", ctx, torch.cat([template, ctx[p:q]]), ctx[q : q + steps + 1].clone(),
                                      depth, p, q)
                break
            p += 1
        if task is None:  # too deep for the continuation: take the last prefix that fits
            p = n - steps - 1
            while p > 0:
                p -= 1
                if not starts[p]:
                    continue
                q, seen = p, 0
                while q < n and (seen < words or not starts[q]):
                    seen += starts[q]
                    q += 1
                if q + steps + 1 <= n and _occurrences(ctx_list, ctx_list[p:q]) == 1:
                    task = FarContextTask("copy", ctx, torch.cat([template, ctx[p:q]]),
                                          ctx[q : q + steps + 1].clone(), depth, p, q)
                    break
        if task is None:
            raise ValueError(f"no unique {words}-word passage at depth {depth} of a {n}-token context")
        if task.question.numel() > reserve:
            raise ValueError(f"question of {task.question.numel()} tokens exceeds reserve {reserve}")
        tasks.append(task)
    return tasks


def decode_inputs(task: FarContextTask, setting: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(prompt, fed, first_scored)`` int64 tensors for one setting.

    ``prompt`` is prefilled (and compressed, for a press); ``fed`` is teacher-forced after it;
    the logits of ``fed[first_scored:]`` predict ``continuation[1:]`` (``steps`` positions).
    Setting ``"A"``: prompt = context + question. Setting ``"B"``: prompt = context, and the
    question is fed after compression. For ``plain`` both are the same.
    """
    cont = task.continuation[:-1]
    if setting == "A" or task.kind == "plain":
        return torch.cat([task.context, task.question]), cont, 0
    if setting == "B":
        return task.context, torch.cat([task.question, cont]), int(task.question.numel())
    raise ValueError(f"unknown setting {setting!r} (A or B)")
