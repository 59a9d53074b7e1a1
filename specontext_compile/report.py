"""The main job: generate with the backend on a real prompt and compare with dense decoding.

Measures, in one process on the same machine (docs/report.md explains each figure):

- ``decode_ms_sparse``: median wall time of a compiled decode step (steps used for the
  recall probe and the first ``warmup`` steps, which include compilation, are excluded);
- ``decode_ms_dense``: median wall time of a Hugging Face eager decode step (dense SDPA,
  ``DynamicCache``) over the same tokens;
- ``greedy_agreement``: teacher-forced agreement: the dense model is fed the sparse run's
  tokens and, at every decode step, its greedy choice is compared with the sparse one (both
  saw the same history, so one early difference does not count twice);
- ``attention_recall``: at a few sampled decode steps, the share of each layer/head's dense
  attention mass (over every cached token) that its selection covers. The recall probe
  (:class:`~.recall.RecallProbe`) reads each attention node's arguments as an
  ``fx.Interpreter`` runs the lowered step, which inductor's compiled step does not allow,
  so it is measured on a second, teacher-forced pass of the same tokens through the same
  lowered step run eagerly (what ``inner="eager"`` runs): the same functions;
- ``path_counts``: the sparse run's ``SpeContextCache.path_counts()``: decode steps, sparse
  sites, gathered / dense-store sites and the sites the fidelity guard ran dense.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import torch
from tqdm.auto import tqdm

from . import api
from .backend import compile_reports
from .config import SpeContextConfig
from .recall import RecallProbe

logger = logging.getLogger(__name__)

__all__ = ["RunReport", "build_prompt", "run_report"]


@dataclasses.dataclass
class RunReport:
    """Figures of one run (the keys ``--json`` writes)."""

    model: str
    prompt_tokens: int
    new_tokens: int
    budget: int
    sites_total: int
    sites_rewritten: int
    retrieval_layers: tuple[int, ...]
    greedy_agreement: float
    attention_recall: float
    decode_ms_sparse: float
    decode_ms_dense: float
    speedup: float
    kv_bytes: int
    text: str
    candidates: float = 1.0
    min_coverage: float = 0.0
    page_rescue: int = 0
    dense_layers: tuple = ()  # option dense_layers: layers whose decode attention stayed dense
    path_counts: dict = dataclasses.field(default_factory=dict)  # SpeContextCache.path_counts() of the sparse run
    first_token_s: float = float("nan")  # the prefill call: dynamo's trace of the prefill graph and the prefill
    first_decode_step_s: float = float("nan")  # the first decode call: its compile (or cache load) and its step
    compile_cache: str = ""  # --compile-cache: "loaded", "missing" (this run made it) or "" (none given)


def build_prompt(tokenizer, text: str) -> torch.Tensor:
    """``[1, tokens]`` input ids: the text as one user turn of the chat template, if any."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True,
            return_tensors="pt", return_dict=True,
        )["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt").input_ids
    return ids


class _StepTimer:
    """Forward hooks that time every call of the model."""

    def __init__(self, model: torch.nn.Module, bar: tqdm | None):
        self.times: list[float] = []
        self.bar = bar
        self._handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
        ]

    def _before(self, module, args):
        self._t0 = time.perf_counter()

    def _after(self, module, args, output):
        self.times.append(time.perf_counter() - self._t0)
        if self.bar is not None:
            self.bar.update(1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _median_ms(times: list[float], skip: set[int]) -> float:
    kept = [t for i, t in enumerate(times) if i not in skip]
    return 1000.0 * statistics.median(kept) if kept else float("nan")


def _sparse_generate(model, input_ids, max_new_tokens, options, warmup):
    api.compile(model, **options)
    cache = api.make_cache(model, input_ids, max_new_tokens)
    bar = tqdm(total=max_new_tokens, desc="sparse generate", leave=False)
    timer = _StepTimer(model, bar)
    try:
        with torch.no_grad():
            out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, cache=cache)
    finally:
        timer.remove()
        bar.close()
        api.restore(model)
    skip = {0, *range(1, 1 + warmup)}  # 0 = prefill
    return out[0, input_ids.shape[1]:], timer, _median_ms(timer.times, skip), cache


def _recall_teacher_forced(model, input_ids, tokens, options, probe_steps) -> list[float]:
    """Mean selection recall at each decode call in ``probe_steps`` (call ``k`` feeds
    ``tokens[k-1]``, as in the sparse run), through the lowered step run eagerly."""
    if not probe_steps:
        return []
    probe = RecallProbe()
    forward = torch.compile(model.forward, backend="specontext", options=dict(options, inner=probe.runner))
    cache = api.make_cache(model, input_ids, len(tokens), retrieval_head=options.get("retrieval_head"))
    recalls = []
    with torch.no_grad():
        forward(input_ids=input_ids, cache=cache, use_cache=True)
        for step in tqdm(range(1, max(probe_steps) + 1), desc="recall probe", leave=False):
            token = tokens[step - 1].view(1, 1)
            if step in probe_steps:
                with probe.recording() as record:
                    forward(input_ids=token, cache=cache, use_cache=True)
                recalls.append(record.mean())
            else:
                forward(input_ids=token, cache=cache, use_cache=True)
    return recalls


def _dense_teacher_forced(model, input_ids, tokens, warmup):
    """Dense eager decoding fed the sparse tokens: (greedy choices, median step ms)."""
    from transformers import DynamicCache

    cache, times, choices = DynamicCache(config=model.config), [], []
    with torch.no_grad():
        logits = model(input_ids, cache=cache, use_cache=True).logits[:, -1]
        choices.append(int(logits.argmax(-1)))
        for tok in tqdm(tokens[:-1].tolist(), desc="dense teacher-forced", leave=False):
            t0 = time.perf_counter()
            logits = model(torch.tensor([[tok]]), cache=cache, use_cache=True).logits[:, -1]
            times.append(time.perf_counter() - t0)
            choices.append(int(logits.argmax(-1)))
    return choices, _median_ms(times, set(range(warmup)))


def run_report(model, tokenizer, prompt_text: str, *, model_name: str, budget: int,
               max_new_tokens: int, recall_samples: int = 4, warmup: int = 2,
               **options) -> RunReport:
    """Run the sparse generation and the dense comparison; see the module docstring.

    Raises:
        ValueError: the prompt plus ``max_new_tokens`` needs more positions than the model's
            ``max_position_embeddings`` (its text past them is unreliable), naming both.
    """
    input_ids = build_prompt(tokenizer, prompt_text)
    n = max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and input_ids.shape[1] + n > limit:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) plus --max-new-tokens {n} needs "
                         f"{input_ids.shape[1] + n} positions, more than {model_name}'s {limit} "
                         f"(max_position_embeddings: it was not trained past them, so its text there is "
                         f"unreliable); shorten the prompt file or lower --max-new-tokens")
    if n - 1 - warmup < 8:
        logger.warning("the speed figures come from %d timed decode steps (--max-new-tokens %d minus %d warm-up): "
                       "too few to trust; use --max-new-tokens 32 or more", max(n - 1 - warmup, 0), n, warmup + 1)
    probe_steps = {1 + warmup + i * max(1, (n - 1 - warmup) // recall_samples) for i in range(recall_samples)}
    probe_steps = {s for s in probe_steps if s < n}
    tokens, timer, ms_sparse, cache = _sparse_generate(model, input_ids, n, dict(options, budget=budget), warmup)
    config = SpeContextConfig.from_options(dict(options, budget=budget))
    decode_reports = [r for r in compile_reports() if r.result.phase == "decode"]
    last = decode_reports[-1] if decode_reports else None
    recalls = _recall_teacher_forced(model, input_ids, tokens, dict(options, budget=budget), probe_steps)
    choices, ms_dense = _dense_teacher_forced(model, input_ids, tokens, warmup)
    decoded = list(zip(choices[1:], tokens[1:].tolist()))
    agreement = sum(a == b for a, b in decoded) / len(decoded) if decoded else float("nan")
    return RunReport(
        model=model_name, prompt_tokens=int(input_ids.shape[1]), new_tokens=len(tokens),
        budget=budget,
        sites_total=last.sites_total if last else 0,
        sites_rewritten=last.sites_rewritten if last else 0,
        retrieval_layers=last.result.retrieval_layers if last else (),
        greedy_agreement=agreement,
        attention_recall=statistics.fmean(recalls) if recalls else float("nan"),
        decode_ms_sparse=ms_sparse, decode_ms_dense=ms_dense,
        speedup=ms_dense / ms_sparse if ms_sparse else float("nan"),
        kv_bytes=cache.kv_bytes,
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        candidates=config.selection.candidates, min_coverage=config.selection.min_coverage,
        page_rescue=config.selection.page_rescue, dense_layers=config.selection.dense_layers,
        path_counts=cache.path_counts(),
        first_token_s=timer.times[0] if timer.times else float("nan"),
        first_decode_step_s=timer.times[1] if len(timer.times) > 1 else float("nan"),
    )
