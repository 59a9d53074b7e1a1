"""Family matrix helpers: the tiny random decoders of ``specontext_compile.tiny_models`` run
eagerly (dense) and through the specontext backend."""

from __future__ import annotations

import torch

from specontext_compile.tiny_models import FAMILIES, VOCAB, tiny_family  # noqa: F401

PROMPT_TOKENS, DECODE_STEPS, BUDGET = 30, 20, 128


def _decode(forward, ids, steps, cache) -> list[torch.Tensor]:
    """Prefill then greedy decode; last-position logits ``[1, vocab]`` of every call."""
    out = []
    with torch.no_grad():
        logits = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        for _ in range(steps):
            logits = forward(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    return out


def run_family(family: str, attn: str, **options) -> dict:
    """Eager dense (``DynamicCache``) vs compiled specontext (``SpeContextCache``) decoding
    (backend ``options``; default ``budget=BUDGET``, which covers the whole context).

    Returns a dict: ``eager`` and ``compiled`` (lists of ``[1, vocab]`` last-position
    logits: prefill + ``DECODE_STEPS`` steps; eager decodes greedily, the compiled run is
    fed the eager run's tokens, so one near-tie cannot make the runs diverge),
    ``max_err`` (max |diff| over all of them), ``decode_sites``/``decode_rewritten`` (sites in the graphs compiled during the
    decode steps and how many were rewritten), ``reasons`` (set of fallback reasons there),
    ``sparse_calls`` (sparse attention calls in the decode steps), ``reports``.

    Raises:
        ValueError: from transformers when ``family`` has no ``attn`` implementation.
    """
    from transformers import DynamicCache

    import specontext_compile as sc

    model = tiny_family(family, attn)
    ids = torch.randint(0, VOCAB, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    eager = _decode(model.forward, ids, DECODE_STEPS, DynamicCache(config=model.config))
    compiled_forward = torch.compile(model.forward, backend="specontext", options={"budget": BUDGET, **options})
    cache = sc.SpeContextCache(model.config, max_cache_len=PROMPT_TOKENS + DECODE_STEPS + 1)
    with torch.no_grad():
        first = compiled_forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    seen = {id(r) for r in sc.compile_reports()}  # the report list is bounded: compare by identity
    calls_before = cache.path_counts()["sparse_sites"]
    compiled = [first]
    with torch.no_grad():
        for step in range(DECODE_STEPS):
            nxt = eager[step].argmax(-1, keepdim=True)
            compiled.append(compiled_forward(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1])
    decode_reports = [r for r in sc.compile_reports() if id(r) not in seen]
    sites = [s for r in decode_reports for s in r.result.sites]
    return {
        "eager": eager,
        "compiled": compiled,
        "max_err": max((a - b).abs().max().item() for a, b in zip(compiled, eager)),
        "decode_sites": len(sites),
        "decode_rewritten": sum(r.result.rewritten for r in decode_reports),
        "reasons": sorted({s.reason for s in sites if s.reason}),
        "unexplained": [s for s in sites if not s.reason and s.node.target is not torch.ops.specontext.sparse_attention.default],
        "sparse_calls": cache.path_counts()["sparse_sites"] - calls_before,  # counted by the compiled step
        "reports": decode_reports,
        "model": model,
    }
