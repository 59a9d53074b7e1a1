"""Decode speed, throughput and memory of specontext against dense peers, side by side.

One process, one run. For every (model, context, batch) configuration and every contender
it measures, on the same prompt and the same machine:

* ``prefill_s``: seconds of the batch-1 dense prefill (Hugging Face eager, SDPA); the other
  contenders start from a copy of that KV cache (see "What is shared" below);
* ``first_step_s``: the first decode call of this shape (includes compilation for the
  compiled contenders: inductor compiles once per shape, specontext traces once per shape);
* decode ms/token over ``--steps`` steps after ``--warmup`` steps: median, p10/p90, min, max;
* ``tokens_per_s``: ``batch * 1000 / median ms``;
* ``peak_rss_bytes``: the process's peak resident memory during this contender's decode
  (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; falls back to the
  process-lifetime peak where that is not allowed), and ``kv_bytes``: bytes the cache holds;
* ``floor_ms``: (bytes of weights + bytes of KV this step must read) / copy bandwidth
  measured at the start of the same run (a large ``copy_``, bytes read + written).

Contenders: ``hf-eager`` (``DynamicCache``, dense SDPA), ``hf-static-inductor`` (``StaticCache``
+ ``torch.compile(model.forward)`` with inductor, dense; ``hf-static-openvino``: the same with
OpenVINO's ``torch.compile`` backend, ``openvino.torch``), ``own-dense`` (the strongest dense
step we build: our pass and inductor with every site dense over the store — a budget above
every store, static shapes per context, the one-row linear rewrite and freezing included —
the baseline every speed-up is stated against), ``specontext-<budget>``
(``torch.compile(model.forward, backend="specontext")`` with a ``SpeContextCache``).
OpenVINO GenAI runs as a peer (``openvino-fp32``: fp32 weights, compute and KV cache;
``openvino-default``: its CPU defaults; ``openvino-evict-<budget>``: fp32 with its KV cache
eviction at our budget): ``benchmarks/openvino_peer.py`` in ``.venv-openvino`` (``bash
scripts/openvino_venv.sh``), as a subprocess, on the same prompt token ids, real weights and
batch 1 only. Its prefill is its own: ``prefill_s`` is its first-token time (load excluded).

Greedy agreement, every contender: the share of the first 64 generated tokens equal to a dense
fp32 reference's (Hugging Face eager fp32 greedy decoding from the same prefill: the prefill's
token, then 63 decode steps; ``model.generate`` gives the same tokens) and the index of the
first differing token. Our contenders start from the shared prefill's token, so index 0 agrees
by construction; OpenVINO's token 0 comes from its own prefill.

Models: ``smollm2-135m`` (real weights, the first tokens of ``pydoc_data.topics``) for
``--contexts``; a random-weight model of the same shape with more positions for
``--random-contexts`` (decode speed does not depend on weight values: its KV cache is filled
with random values instead of a prefill); ``tiny`` (a small random Llama, for smoke tests).

What is shared: batch rows are the same prompt (equal length; the prefilled KV is copied
into every row), so prefill runs once per context at batch 1. Every ratio is computed
within this run.

    python -m benchmarks.decode                       # full matrix (see docs/benchmarks.md)
    python -m benchmarks.decode --quick               # smoke test, about a minute
    python -m benchmarks.decode --model tiny --quick --json /tmp/b.json --no-plots
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONTENDERS = ("hf-eager", "hf-static-inductor", "own-dense", "specontext-512", "specontext-1024",
              "specontext-2048")
# own-dense: every site dense over the store (budget >= any store: the pass's dense shortcut,
# SDPA over the store with the causal limit), compiled per shape (dynamic=False keeps the
# store length static, so the shortcut is decided from shapes on every graph)
# regional=False: the graph compiled whole (its weights stay graph inputs: the backend's default
# freezing patch folds nothing; own-dense-frozen folds them), the faster step (regional compilation
# costs the step ~11% at 30 layers: docs/benchmarks.md, "Compile time"), the slower compile
OWN_DENSE = {"options": {"budget": 1 << 30, "page_rescue": 0, "regional": False}, "dynamic": False}
# the backend's frozen step (weights folded in: specontext_compile/freezing.py) with inductor's
# CPP GEMM template for the linear layers (max_autotune; gemv off so that they stay matmuls)
FROZEN = {"freezing": True, "mode": "max-autotune", "gemv": False}
OWN_DENSES = {"own-dense": OWN_DENSE,
              "own-dense-frozen": {**OWN_DENSE, "options": {**OWN_DENSE["options"], **FROZEN}}}
ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "results"  # raw figures; the pages that cite them are in docs/
# OpenVINO GenAI, the peer run by benchmarks/openvino_peer.py in its own venv
OPENVINO_VENV = ROOT / ".venv-openvino"
OPENVINO_MODEL = ROOT / "out" / "openvino" / "smollm2-135m"
# contender -> the peer's config; and openvino-evict-<budget> -> evict-<budget>
OPENVINO_CONFIGS = {"openvino-fp32": "fp32-dense", "openvino-default": "default"}
AGREE_TOKENS = 64  # greedy agreement with the dense fp32 reference over this many generated tokens
logger = logging.getLogger(__name__)
# --dtypes: what users load; the weights and the KV cache both take the dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------- machine


def measure_copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large ``copy_`` (bytes read + bytes written), best of ``repeats``."""
    n = megabytes * 2**20 // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter of this process; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident bytes since the last :func:`reset_peak_rss` (or process start)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def rss_bytes() -> int:
    """Current resident bytes of this process (0 where unknown)."""
    return (_status_kib("VmRSS") or 0) * 1024


# what decides bf16/int8 compute paths on a CPU (AMX: Intel's tile units; AMD EPYC has none)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def machine_info() -> dict:
    """CPU, cores, memory and library versions, for the record."""
    import transformers

    cpu, flags = platform.processor() or "", set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.readlines()
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        cpu = names[0] if names else cpu
        flags = next((set(line.split(":", 1)[1].split()) for line in lines
                      if line.startswith("flags")), set())
    except OSError:
        pass
    mem = _meminfo_total()
    return {
        "cpu": cpu, "cpu_flags": {f: f in flags for f in CPU_FLAGS},
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "memory_bytes": mem, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "platform": platform.platform(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------- models


def tiny_config():
    """A small random Llama (4 layers, GQA 6/2, head_dim 16) for smoke tests."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1 << 16,
        attn_implementation="sdpa", tie_word_embeddings=True,
    )


def random_model(config, seed: int = 0):
    """An eval-mode random-weight causal LM of ``config`` (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def random_like(model, max_positions: int):
    """A random-weight model of ``model``'s shape with at least ``max_positions`` positions."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.max_position_embeddings = max(config.max_position_embeddings, max_positions)
    return random_model(config, seed=1)


def real_text_ids(tokenizer, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids: the first ``tokens`` tokens of ``pydoc_data.topics`` (real text)."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"pydoc_data.topics has {ids.shape[1]} tokens, fewer than {tokens}")
    return ids[:, :tokens]


# --------------------------------------------------------------------------- caches


def kv_layout(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder config."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", heads), head_dim


def cache_tensors(cache) -> list[torch.Tensor]:
    """The key/value tensors a Hugging Face cache holds."""
    out = []
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def cache_bytes(cache) -> int:
    """Bytes held by a cache's key/value tensors (allocated, not only written)."""
    return sum(t.numel() * t.element_size() for t in cache_tensors(cache))


def make_cache(kind: str, config, capacity: int):
    """An empty cache for a contender kind."""
    from transformers import DynamicCache, StaticCache

    if kind == "hf-eager":
        return DynamicCache(config=config)
    if kind.startswith("hf-static-") or kind.startswith("specontext-static-"):
        return StaticCache(config, max_cache_len=capacity)  # specontext-static-*: the backend adopts it
    from specontext_compile import SpeContextCache, SpeContextConfig

    options = parse_specontext(kind)[1] if kind.startswith("specontext-") else {}
    picked = SpeContextConfig.from_options(options)  # the option's default resolved
    return SpeContextCache(config, max_cache_len=capacity, selection_keys=picked.selection_keys,
                           retrieval_layers=picked.retrieval_layers)


def fill_cache(cache, source: list[tuple[torch.Tensor, torch.Tensor]], batch: int) -> None:
    """Write ``source`` (per layer ``(keys, values)`` ``[1, kv, n, d]``) into every row."""
    for layer, (k, v) in enumerate(source):
        cache.update(k.expand(batch, -1, -1, -1).contiguous(),
                     v.expand(batch, -1, -1, -1).contiguous(), layer)


# --------------------------------------------------------------------------- contenders


class Forwards:
    """One forward per contender, compiled once and reused across shapes (compile and
    recompile time show up in ``first_step_s``)."""

    def __init__(self, model):
        self.model = model
        self._fns: dict[str, object] = {}

    def get(self, name: str):
        if name not in self._fns:
            if name == "hf-eager":
                self._fns[name] = self.model.forward
            elif name == "hf-static-openvino":
                self._fns[name] = openvino_torch_forward(self.model)
            elif name.startswith("hf-static-"):
                self._fns[name] = torch.compile(self.model.forward, **HF_STATIC[name])
            elif name in OWN_DENSES:
                self._fns[name] = torch.compile(self.model.forward, backend="specontext", **OWN_DENSES[name])
            else:
                budget, options = parse_specontext(name)
                self._fns[name] = torch.compile(
                    self.model.forward, backend="specontext", options={"budget": budget, **options})
        return self._fns[name]


# HF StaticCache + inductor, as Hugging Face compiles decoding; "-cudagraphs" is HF's default
# mode (CUDA graphs; on CPU inductor skips them), "-frozen" adds inductor's freezing option
# (which, given as an option, reaches inductor after dynamo lifted the weights to graph inputs,
# so it likely freezes nothing: docs/benchmarks.md, "Freezing that takes effect")
HF_STATIC = {
    "hf-static-inductor": {"backend": "inductor"},
    "hf-static-frozen": {"backend": "inductor", "options": {"freezing": True}},
    "hf-static-cudagraphs": {"backend": "inductor", "mode": "reduce-overhead"},
    # OpenVINO's torch.compile backend (``openvino.torch``, the ``openvino`` wheel in this venv:
    # ``pip install openvino``) as the compiler of the same dense step: issue 51's candidate
    # inner compiler; options are its documented ones, through AOTAutograd (its direct path
    # fails on torch 2.13: a shape guard without a source)
    "hf-static-openvino": {"backend": "openvino", "options": {"aot_autograd": True}},
}


def openvino_torch_forward(model):
    """``torch.compile(model.forward, backend="openvino")``: imports ``openvino.torch`` (which
    registers the backend) only here; a clear error when the wheel is missing."""
    try:
        import openvino.torch  # noqa: F401  (registers the "openvino" backend)
    except ImportError as err:
        raise SystemExit("contender hf-static-openvino needs OpenVINO's wheel in this venv: "
                         ".venv/bin/pip install openvino==2026.4.1") from err
    return torch.compile(model.forward, **HF_STATIC["hf-static-openvino"])
# specontext-[<variant>-]<budget>; no variant = the backend's defaults
SPECONTEXT_VARIANTS = {
    "": {},
    "eager": {"inner": "eager"},  # the lowered step without inductor
    "chain": {"inner": "eager", "lower": False},  # the op chain, one op at a time
    "inductor": {"inner": "inductor"},
    "opaque": {"inner": "inductor", "lower": False},  # inductor around our ops left opaque
    "cudagraphs": {"inner": "inductor", "mode": "reduce-overhead"},
    "c2": {"candidates": 2.0},  # two-stage selection (issue 12): 2 x budget candidates, per-layer top budget
    "c4": {"candidates": 4.0},
    "cinf": {"candidates": math.inf},  # every layer its own exact top budget (reads every key, in place)
    # the five retrieval layers of the 30-layer default before issue 12's second pass (now eight)
    "r5": {"retrieval_layers": (2, 4, 8, 12, 20)},
    "r5c4": {"retrieval_layers": (2, 4, 8, 12, 20), "candidates": 4.0},
    # the page rescue (issue 12): each layer adds the tokens of its best pages by Quest's bound
    "p0": {"page_rescue": 0},  # no page rescue (the default before issue 12's third pass)
    "p1k": {"page_rescue": 1024},
    "p2k": {"page_rescue": 2048},
    "c2p2k": {"candidates": 2.0, "page_rescue": 2048},
    "c4p1k": {"candidates": 4.0, "page_rescue": 1024},
    "d0": {"dense_layers": (0,)},  # layer 0 kept dense (option dense_layers), the rescue at its default
    "below16k": {"dense_below": 16384},  # dense over stores of <= 16K tokens (option dense_below)
    "k8": {"selection_keys": "int8"},  # the selection scores the retrieval layers' int8 key rows (the default)
    "ks": {"selection_keys": "store"},  # the selection scores the stores' keys (the default before issue 51's flip)
    "static": {},  # Hugging Face's StaticCache, adopted by the backend (issue 13): the HF recipe
    "frozen": FROZEN,  # weights folded and frozen, linear layers on inductor's CPP GEMM template
}


def parse_specontext(name: str) -> tuple[int, dict]:
    """(budget, backend options) of ``specontext-[<variant>-]<budget>``."""
    parts = name.split("-")
    try:
        if parts[0] != "specontext" or len(parts) not in (2, 3):
            raise ValueError
        variant = parts[1] if len(parts) == 3 else ""
        return int(parts[-1]), dict(SPECONTEXT_VARIANTS[variant])
    except (ValueError, KeyError):
        raise ValueError(f"unknown contender {name!r}: use hf-eager, own-dense, "
                         f"{', '.join(HF_STATIC)}, "
                         f"specontext-[<variant>-]<budget> with variant one of "
                         f"{[v for v in SPECONTEXT_VARIANTS if v]}, {', '.join(OPENVINO_CONFIGS)} "
                         f"or openvino-evict-<budget>") from None


def parse_budget(name: str) -> int:
    """Budget of ``specontext-[<variant>-]<budget>``."""
    return parse_specontext(name)[0]


def check_contenders(names: list[str]) -> list[str]:
    for name in names:
        if is_openvino(name):
            parse_openvino(name)
        elif name != "hf-eager" and name not in OWN_DENSES and name not in HF_STATIC:
            parse_specontext(name)
    return names


def is_openvino(name: str) -> bool:
    return name.startswith("openvino-")


def parse_openvino(name: str) -> str:
    """The peer's config of ``openvino-fp32``, ``openvino-default`` or ``openvino-evict-<budget>``
    (the budget a multiple of its 32-token KV block, above the 160 tokens it always keeps)."""
    if name in OPENVINO_CONFIGS:
        return OPENVINO_CONFIGS[name]
    budget = name.removeprefix("openvino-evict-")
    if name.startswith("openvino-evict-") and budget.isdigit() and int(budget) % 32 == 0 \
            and int(budget) > 160:
        return f"evict-{budget}"
    raise ValueError(f"unknown contender {name!r}: use {', '.join(OPENVINO_CONFIGS)} or "
                     "openvino-evict-<budget> (a multiple of 32 above 160)")


def openvino_python(venv: Path | None = None, model: Path | None = None) -> Path:
    """The OpenVINO venv's interpreter (default :data:`OPENVINO_VENV`, :data:`OPENVINO_MODEL`);
    raises ``RuntimeError`` naming the setup script when the venv or the exported model is
    missing."""
    venv, model = venv or OPENVINO_VENV, model or OPENVINO_MODEL
    python = venv / "bin" / "python"
    missing = [str(p) for p in (python, model / "openvino_model.xml") if not p.exists()]
    if missing:
        raise RuntimeError(f"the openvino-* contenders need {' and '.join(missing)}: run "
                           "`bash scripts/openvino_venv.sh` (makes .venv-openvino and exports "
                           "SmolLM2 to out/openvino/smollm2-135m)")
    return python


def agreement(tokens: list[int], reference: list[int], n: int = AGREE_TOKENS) -> dict:
    """Greedy agreement of ``tokens`` with ``reference`` over the first ``n``: the share of equal
    positions, the index of the first differing one (``None``: none differs), positions compared."""
    pairs = list(zip(tokens[:n], reference[:n]))
    if not pairs:
        return {"agree_share": None, "agree_first_diff": None, "agree_tokens": 0}
    diffs = [i for i, (a, b) in enumerate(pairs) if a != b]
    return {"agree_share": 1 - len(diffs) / len(pairs),
            "agree_first_diff": diffs[0] if diffs else None, "agree_tokens": len(pairs)}


def floor_bytes(name: str, config, weight_bytes: int, context: int, batch: int,
                elem: int = 4) -> tuple[int, int]:
    """(weight bytes, KV bytes) a decode step of ``name`` must read at ``context`` tokens.

    Dense reads every cached key and value of every layer. specontext reads, per layer,
    ``min(budget, context)`` selected keys and values, plus the full key store of each
    retrieval layer (the lagged-query head scores every cached token); with the two-stage
    selection (``candidates`` c > 1) each layer reads the keys of ``min(ceil(c * budget),
    context)`` candidates (to score them with its own query) and the values of the
    ``budget`` it keeps. The page rescue (``page_rescue`` r) adds, per layer, the page
    bounds (``2 / 16`` of the context's keys) and the keys of ``r`` more tokens. A layer kept
    dense (``dense_layers``) reads its whole K and V instead. With ``selection_keys="int8"`` the
    retrieval layers' keys are read as int8 rows (``head_dim`` bytes and a float32 scale).
    """
    from specontext_compile.config import SpeContextConfig, candidate_slots, default_retrieval_layers
    from specontext_compile.runtime.page_bounds import PAGE_TOKENS

    layers, kv_heads, head_dim = kv_layout(config)
    per_token = kv_heads * head_dim * elem  # one of K or V, one layer
    if name.startswith("specontext"):
        budget, options = parse_specontext(name)
        selected = min(budget, context)
        config_ = SpeContextConfig(budget=budget, **options)
        rescue = config_.page_rescue  # resolves the default (2 x budget)
        keys = candidate_slots(budget, options.get("candidates", 1.0))
        if keys >= context:  # every position: keys read in place, no page bounds (candidates=inf)
            keys = context
        elif rescue:  # + the rescued keys and the page bounds (a min and a max row per page)
            keys = min(keys + rescue, context) + 2 * -(-context // PAGE_TOKENS)
        retrieval = len(options.get("retrieval_layers", default_retrieval_layers(layers)))
        dense = len(config_.dense_layers)  # (a dense retrieval layer: its keys counted for both reads)
        scored = kv_heads * (head_dim + 4) if config_.selection.selection_keys == "int8" else per_token
        kv = batch * (((layers - dense) * (keys + selected) + dense * 2 * context) * per_token
                      + retrieval * context * scored)
    else:
        kv = batch * layers * 2 * context * per_token
    return weight_bytes, kv


def param_bytes(model) -> int:
    """Bytes of the model's distinct parameters and buffers (tied weights counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _step(forward, tokens, cache):
    out = forward(input_ids=tokens, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True)


def run_contender(name, forwards, config, source, first_token, context, batch, steps, warmup,
                  bar=None) -> dict:
    """Decode ``warmup + steps`` tokens (after one first call) with one contender, then untimed
    up to :data:`AGREE_TOKENS` generated tokens (``tokens``: row 0's, the first token included)."""
    gc.collect()
    rss0 = rss_bytes()
    exact_peak = reset_peak_rss()
    capacity = context + max(warmup + steps + 2, AGREE_TOKENS) + 1
    cache = make_cache(name, config, capacity)
    with torch.no_grad():
        fill_cache(cache, source, batch)
        tok = first_token.expand(batch, 1).contiguous()
        tokens = [int(tok[0, 0])]
        forward = forwards.get(name)
        t0 = time.perf_counter()
        tok = _step(forward, tok, cache)
        first = time.perf_counter() - t0
        tokens.append(int(tok[0, 0]))
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            tok = _step(forward, tok, cache)
            dt = time.perf_counter() - t0
            tokens.append(int(tok[0, 0]))
            if i >= warmup:
                times.append(dt)
            if bar is not None:
                bar.update(1)
        while len(tokens) < AGREE_TOKENS:  # untimed: only for the greedy agreement
            tok = _step(forward, tok, cache)
            tokens.append(int(tok[0, 0]))
    kv = cache_bytes(cache)
    peak = peak_rss_bytes()
    sites = None
    if name.startswith("specontext") or name in OWN_DENSES:
        from specontext_compile import compile_reports

        decode = [r for r in compile_reports() if r.result.phase == "decode"]
        sites = f"{decode[-1].sites_rewritten}/{decode[-1].sites_total}" if decode else None
    del cache
    gc.collect()
    return {
        "first_step_s": first, **step_stats([1000 * t for t in times], warmup, batch),
        "kv_bytes": kv, "peak_rss_bytes": peak, "rss_before_bytes": rss0,
        "peak_rss_exact": exact_peak, "sites_rewritten": sites, "tokens": tokens,
    }


def step_stats(ms: list[float], warmup: int, batch: int) -> dict:
    """Median, p10/p90, min, max of timed step milliseconds, and tokens/s."""
    ms = sorted(ms)
    q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) >= 2 else [ms[0]] * 9
    median = statistics.median(ms)
    return {"steps": len(ms), "warmup": warmup, "ms_median": median, "ms_p10": q[0],
            "ms_p90": q[-1], "ms_min": ms[0], "ms_max": ms[-1],
            "tokens_per_s": batch * 1000.0 / median}


def reference_tokens(model, source, first_token, n: int = AGREE_TOKENS) -> list[int]:
    """The dense fp32 reference of the greedy agreement: Hugging Face eager greedy decoding
    (``DynamicCache``, SDPA) from the prefill's per-layer (K, V) ``source`` and its token
    ``first_token`` (``[1, 1]``), ``n`` tokens with that one; ``model`` must be the fp32 model.
    On a prompt, these are ``model.generate(ids, do_sample=False, max_new_tokens=n)``'s tokens."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    fill_cache(cache, source, 1)
    tok, tokens = first_token, [int(first_token[0, 0])]
    with torch.no_grad():
        while len(tokens) < n:
            tok = _step(model.forward, tok, cache)
            tokens.append(int(tok[0, 0]))
    return tokens


# --------------------------------------------------------------------------- OpenVINO peer


def run_openvino(name: str, ids: torch.Tensor, max_new_tokens: int, warmup: int,
                 threads: int) -> dict:
    """Run ``benchmarks/openvino_peer.py`` in ``.venv-openvino`` on the prompt ``ids``
    (``[1, n]``) for one ``openvino-*`` contender; returns the peer's JSON."""
    python = openvino_python()
    with tempfile.TemporaryDirectory(prefix="openvino-peer-") as tmp:
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids[0].tolist()))
        request = {"ids_file": str(ids_file), "config": parse_openvino(name),
                   "model": str(OPENVINO_MODEL), "max_new_tokens": max_new_tokens,
                   "warmup": warmup, "threads": threads}
        proc = subprocess.run([str(python), "-m", "benchmarks.openvino_peer"], cwd=ROOT,
                              input=json.dumps(request), capture_output=True, text=True,
                              timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: benchmarks/openvino_peer.py failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def openvino_result(peer: dict, steps: int, warmup: int) -> dict:
    """A row's measured fields from the peer's JSON: the same statistics over the same steps
    (after its first decode step and ``warmup`` more); its first-token time as ``prefill_s``."""
    ms = peer["step_ms"][1 + warmup:1 + warmup + steps]
    return {
        "prefill_s": peer["first_token_s"], "first_step_s": peer["step_ms"][0] / 1000,
        **step_stats(ms, warmup, 1), "kv_bytes": None, "peak_rss_bytes": peer["peak_rss_bytes"],
        "rss_before_bytes": None, "peak_rss_exact": False, "sites_rewritten": None,
        "tokens": peer["tokens"],
        "openvino": {k: peer[k] for k in ("config", "load_s", "threads", "properties", "applied",
                                          "scheduler_config", "versions", "step_ms",
                                          "openvino_step_ms", "openvino_ttft_s",
                                          "openvino_tpot_ms")},
    }


def openvino_floor(name: str, config, weight_bytes: int, context: int,
                   applied: dict) -> tuple[int, int]:
    """(weight bytes, KV bytes) an OpenVINO step must read: weights at its inference precision,
    dense KV at its cache precision over the context (``evict-<b>``: over at most b tokens)."""
    elem = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "i8": 1}
    weights = weight_bytes * elem.get(applied.get("INFERENCE_PRECISION_HINT"), 4) // 4
    kv_elem = elem.get(applied.get("key_cache_input_type"), 4)
    config_name = parse_openvino(name)
    evict = config_name.startswith("evict-")
    held = min(context, int(config_name.split("-")[1])) if evict else context
    return weights, floor_bytes("hf-eager", config, 0, held, 1, elem=kv_elem)[1]


# --------------------------------------------------------------------------- runs


@dataclasses.dataclass
class Group:
    """Contexts measured with one model."""

    label: str  # "smollm2-135m (real weights)", ...
    weights: str  # "real" or "random"
    contexts: list[int]
    batches: list[int]


def prefill_source(model, ids):
    """Dense eager prefill (batch 1): (seconds, per-layer (K, V), first decoded token)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    source = [(layer.keys, layer.values) for layer in cache.layers]
    return seconds, source, out.logits[:, -1].argmax(-1, keepdim=True)


def random_source(config, context: int, seed: int = 0):
    """Random per-layer (K, V) of ``context`` tokens, for random-weight models."""
    layers, kv_heads, head_dim = kv_layout(config)
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, kv_heads, context, head_dim, generator=g),
             torch.randn(1, kv_heads, context, head_dim, generator=g)) for _ in range(layers)]


def run_group(model, tokenizer, group: Group, contenders, steps, warmup, bandwidth, bar,
              rows: list[dict], on_row=None, references: dict | None = None,
              reference_model=None) -> list[dict]:
    """Append every (context, batch, contender) row of one model group to ``rows``;
    ``on_row(rows)`` is called after each (to save partial results). The model's dtype is
    the run's: prefill, the random KV and every contender's cache take it. ``references``
    keeps the dense fp32 reference tokens per (weights, context) across calls (see
    :func:`reference_tokens`); ``reference_model``: the fp32 model when ``model`` is not."""
    forwards = Forwards(model)
    dtype = next(model.parameters()).dtype
    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    weight_bytes = param_bytes(model)
    references = {} if references is None else references
    for context in group.contexts:
        ids = None
        if group.weights == "real" and tokenizer is not None:
            ids = real_text_ids(tokenizer, context)
            prefill_s, source, first = prefill_source(model, ids)
        else:
            prefill_s, source = None, [(k.to(dtype), v.to(dtype))
                                       for k, v in random_source(model.config, context)]
            first = torch.tensor([[1]])
        key = f"{group.weights}/ctx={context}"
        if key not in references:
            fp32 = dtype == torch.float32
            references[key] = (_reference(model, ids, source, first, context) if fp32 else
                               _reference(reference_model, ids, None, None, context))
        for batch in group.batches:
            for name in contenders:
                if bar is not None:
                    bar.set_postfix_str(f"{group.weights} ctx={context} b={batch} {name}")
                if is_openvino(name):
                    if _openvino_skip(name, ids, batch, dtype_name, bar):
                        continue
                    result = openvino_result(run_openvino(
                        name, ids, max(AGREE_TOKENS, warmup + steps + 2), warmup,
                        torch.get_num_threads()), steps, warmup)
                    wb, kvb = openvino_floor(name, model.config, weight_bytes, context,
                                             result["openvino"]["applied"])
                else:
                    result = run_contender(name, forwards, model.config, source, first, context,
                                           batch, steps, warmup, bar)
                    wb, kvb = floor_bytes(name, model.config, weight_bytes, context, batch,
                                          elem=torch.finfo(dtype).bits // 8)
                rows.append(_row(group, dtype_name, context, batch, name, prefill_s, result,
                                 (wb, kvb), bandwidth, references[key]))
                if on_row is not None:
                    on_row(rows)
        del source
        gc.collect()
    return rows


def _reference(model, ids, source, first, context: int) -> list[int] | None:
    """Dense fp32 reference tokens at one context (``None`` without an fp32 model): from
    ``source`` and ``first`` when given (the fp32 run's own prefill), else from a fresh fp32
    prefill of ``ids`` (no ids: the fp32 random KV and token 1, as :func:`run_group`)."""
    if model is None:
        return None
    if source is None and ids is not None:
        _, source, first = prefill_source(model, ids)
    elif source is None:
        source, first = random_source(model.config, context), torch.tensor([[1]])
    return reference_tokens(model, source, first)


def _row(group, dtype_name, context, batch, name, prefill_s, result, floor, bandwidth,
         reference) -> dict:
    wb, kvb = floor
    floor_ms = 1000.0 * (wb + kvb) / bandwidth
    tokens = result.pop("tokens")
    agree = agreement(tokens, reference) if reference is not None else {
        "agree_share": None, "agree_first_diff": None, "agree_tokens": 0}
    return {
        "model": group.label, "weights": group.weights, "dtype": dtype_name,
        "context": context, "batch": batch, "contender": name,
        "prefill_s": prefill_s if name == "hf-eager" else None,
        **result,
        "floor_weight_bytes": wb, "floor_kv_bytes": kvb, "floor_ms": floor_ms,
        "x_floor": result["ms_median"] / floor_ms,
        **agree, "agree_reference": "hf-eager-fp32" if reference is not None else None,
        "generated_tokens": tokens,
    }


def _openvino_skip(name, ids, batch, dtype_name, bar) -> bool:
    """True (and says why) where an OpenVINO row cannot be measured: it needs the real prompt's
    ids, runs batch 1, and runs once, in the fp32 pass (its precisions are its config's)."""
    why = ("no real prompt (random weights or the tiny model)" if ids is None else
           f"batch {batch} (it runs batch 1)" if batch != 1 else
           f"the {dtype_name} pass (it runs in the fp32 pass)" if dtype_name != "fp32" else None)
    if why is not None:
        msg = f"{name} skipped: {why}"
        bar.write(msg) if bar is not None else logger.warning(msg)
    return why is not None


def _ratio_key(row: dict) -> str:
    dtype = row.get("dtype", "fp32")  # rows of runs before --dtypes are fp32
    return f"{row['weights']}/{dtype}/ctx={row['context']}/batch={row['batch']}"


def crossovers(rows: list[dict], contender: str, baseline: str = "own-dense") -> list[dict]:
    """Where ``contender`` starts to beat ``baseline``, per (weights, dtype, batch).

    For each series of measured contexts (ascending), the speed-up ``baseline ms /
    contender ms`` at each context, and ``crossover_tokens``: the context where the speed-up
    crosses 1 for good, interpolated linearly in log2(context) between the last measured context
    below 1 and the next (every larger one is at or above 1); ``None`` with ``"always"`` in
    ``note`` when every measured context is at or above 1, ``"never"`` when the largest is
    below 1 (tokens)."""
    ms: dict[tuple, dict[int, dict[str, float]]] = {}
    for r in rows:
        if r["contender"] in (contender, baseline):
            key = (r["weights"], r.get("dtype", "fp32"), r["batch"])
            ms.setdefault(key, {}).setdefault(r["context"], {})[r["contender"]] = r["ms_median"]
    out = []
    for (weights, dtype, batch), by_ctx in sorted(ms.items()):
        pts = [(c, v[baseline] / v[contender]) for c, v in sorted(by_ctx.items())
               if contender in v and baseline in v]
        if not pts:
            continue
        entry = {"weights": weights, "dtype": dtype, "batch": batch, "contender": contender,
                 "baseline": baseline, "speedups": {str(c): s for c, s in pts},
                 "crossover_tokens": None, "note": None}
        below = [i for i, (_, s) in enumerate(pts) if s < 1]
        if not below:
            entry["note"] = "always"
        elif below[-1] == len(pts) - 1:
            entry["note"] = "never"
        else:
            i = below[-1] + 1  # from here on every measured context is at or above 1
            (c0, s0), (c1, s1) = pts[i - 1], pts[i]
            t = (1 - s0) / (s1 - s0)
            entry["crossover_tokens"] = round(2 ** (math.log2(c0) + t * (math.log2(c1) - math.log2(c0))))
        out.append(entry)
    return out


def add_ratios(rows: list[dict]) -> dict:
    """Pairwise speed-ups within each (model, context, batch): ``ratios[key][a][b]`` =
    ms/token of b / ms/token of a (> 1: a is faster)."""
    groups: dict[str, dict[str, float]] = {}
    for row in rows:
        key = _ratio_key(row)
        groups.setdefault(key, {})[row["contender"]] = row["ms_median"]
    ratios = {key: {a: {b: mb / ma for b, mb in ms.items()} for a, ma in ms.items()}
              for key, ms in groups.items()}
    for row in rows:
        key = _ratio_key(row)
        mine = ratios[key][row["contender"]]
        row["speedup_vs_hf_eager"] = mine.get("hf-eager")
        row["speedup_vs_hf_static_inductor"] = mine.get("hf-static-inductor")
        row["speedup_vs_own_dense"] = mine.get("own-dense")
    return ratios


# --------------------------------------------------------------------------- output


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    """The results as a Markdown table."""
    head = ("| weights | dtype | ctx | batch | contender | prefill s | first step s | ms/token median "
            "[p10-p90] | tok/s | floor ms | x floor | **vs own dense** | vs eager | vs inductor | KV MB | "
            "peak RSS MB | agree 64 [first diff] |")
    lines = [head, "|" + "---|" * 17]
    for r in rows:
        lines.append(
            f"| {r['weights']} | {r.get('dtype', 'fp32')} | {r['context']} | {r['batch']} | "
            f"{r['contender']} | "
            f"{_fmt(r['prefill_s'], '.2f')} | {r['first_step_s']:.2f} | "
            f"{r['ms_median']:.1f} [{r['ms_p10']:.1f}-{r['ms_p90']:.1f}] | "
            f"{r['tokens_per_s']:.1f} | {r['floor_ms']:.1f} | {r['x_floor']:.2f} | "
            f"{_fmt(r.get('speedup_vs_own_dense'), '.2f')} | "
            f"{_fmt(r['speedup_vs_hf_eager'], '.2f')} | "
            f"{_fmt(r['speedup_vs_hf_static_inductor'], '.2f')} | "
            f"{_mib(r['kv_bytes'])} | {_mib(r['peak_rss_bytes'])} | {_agree(r)} |")
    return "\n".join(lines)


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _agree(row: dict) -> str:
    share = row.get("agree_share")
    if share is None:
        return "-"
    return f"{share:.2f} [{_fmt(row.get('agree_first_diff'), 'd')}]"


def format_crossovers(rows: list[dict]) -> str:
    """One line per (sparse contender, weights, dtype, batch): speed-up vs own dense by
    context and where it crosses 1 (see :func:`crossovers`)."""
    lines = []
    for name in dict.fromkeys(r["contender"] for r in rows):
        if not name.startswith("specontext"):
            continue
        for c in crossovers(rows, name):
            ups = ", ".join(f"{k}: {v:.2f}x" for k, v in c["speedups"].items())
            where = (f"crosses 1x at ~{c['crossover_tokens']} tokens" if c["crossover_tokens"]
                     else {"always": "faster at every measured context",
                           "never": "slower at the largest measured context"}[c["note"]])
            lines.append(f"{name} vs own dense, {c['weights']} {c['dtype']} batch {c['batch']}: "
                         f"{ups}; {where}")
    return "\n".join(lines)


def write_plots(rows: list[dict], directory: Path, prefix: str) -> list[str]:
    """ms/token vs context per contender (one panel per dtype and batch), floors dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plots", file=sys.stderr)
        return []
    directory.mkdir(parents=True, exist_ok=True)
    panels = sorted({(r.get("dtype", "fp32"), r["batch"]) for r in rows})
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    cols = min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.5 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (dtype, batch) in zip(axes.flat, panels):
        for i, name in enumerate(contenders):
            pts = sorted((r["context"], r["ms_median"], r["floor_ms"], r["weights"])
                         for r in rows if r["batch"] == batch and r["contender"] == name
                         and r.get("dtype", "fp32") == dtype)
            if not pts:
                continue
            color = colors[i % len(colors)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=name)
            if name in ("hf-eager",) or name.startswith("specontext"):
                label = "floor (dense)" if name == "hf-eager" else f"floor ({name})"
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=color,
                        alpha=0.6, label=label)
            for p in pts:
                if p[3] == "random":
                    ax.annotate("rw", (p[0], p[1]), fontsize=6, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens (rw = random weights)")
        ax.set_ylabel("decode ms/token (median)")
        ax.set_title(f"{dtype}, batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    path = directory / f"{prefix}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)] + _speedup_plot(plt, rows, directory, prefix)


def _speedup_plot(plt, rows: list[dict], directory: Path, prefix: str) -> list[str]:
    """Speed-up of each sparse contender over own dense against context, one line per
    (dtype, batch), with 1x drawn: where a line crosses it, sparsity starts to pay."""
    series = [c for name in dict.fromkeys(r["contender"] for r in rows) if name.startswith("specontext")
              for c in crossovers(rows, name)]
    if not series:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for c in series:
        pts = sorted((int(k), v) for k, v in c["speedups"].items())
        label = f"{c['contender']} {c['dtype']} b{c['batch']}" + (" (rw)" if c["weights"] == "random" else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens (rw = random weights)")
    ax.set_ylabel("speed-up over own dense (ms own dense / ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = directory / f"{prefix}_speedup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.decode", description=doc[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc[-1])
    parser.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "tiny"),
                        help="real SmolLM2-135M, or a tiny random Llama (smoke tests)")
    parser.add_argument("--contexts", type=int, nargs="*", default=None,
                        help="prompt tokens, real weights, run in this order "
                             "(default 8192 4096 2048)")
    parser.add_argument("--random-contexts", type=int, nargs="*", default=None,
                        help="contexts on the random-weight model of the same shape "
                             "(default 16384 32768)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes for --contexts, in this order (default 1 8 4)")
    parser.add_argument("--random-batches", type=int, nargs="+", default=None,
                        help="batch sizes for --random-contexts (default 1)")
    parser.add_argument("--contenders", nargs="+", default=None,
                        help=f"subset of {' '.join(CONTENDERS)} (any specontext-<budget>), or "
                             "the OpenVINO peer: openvino-fp32 openvino-default "
                             "openvino-evict-<budget> (bash scripts/openvino_venv.sh first)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=tuple(DTYPES),
                        help="weight and KV dtypes, each a run of every group (default fp32)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 20)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: small contexts, batch 1 and 2, 4 steps")
    parser.add_argument("--json", type=Path, default=None,
                        help="results file (default docs/results/benchmarks_decode.json; "
                             "quick: out/benchmarks_decode_quick.json)")
    parser.add_argument("--plot-dir", type=Path, default=None,
                        help="where plots go, named as the JSON file (default docs/; quick: out/)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--table-from", type=Path, default=None, metavar="JSON",
                        help="print the table of an earlier run's JSON (also a partial one), "
                             "redraw its plots into --plot-dir unless --no-plots, and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--keep-compile-cache", action="store_true",
                        help="reuse inductor's on-disk cache (default: a fresh one, so "
                             "first_step_s shows real compile times)")
    args = parser.parse_args(argv)
    tiny = args.model == "tiny"
    quick = args.quick
    if args.contexts is None:
        args.contexts = ([320, 640] if tiny else [2048]) if quick else (
            [512, 1024, 2048] if tiny else [8192, 4096, 2048])  # most important first
    if args.random_contexts is None:
        args.random_contexts = [] if (quick or tiny) else [16384, 32768]
    if args.batches is None:
        args.batches = [1, 2] if quick else [1, 8, 4]
    if args.random_batches is None:
        args.random_batches = [1]
    if args.contenders is None:
        if quick:
            args.contenders = (["hf-eager", "own-dense", "specontext-256", "specontext-512"] if tiny
                               else ["hf-eager", "own-dense", "specontext-1024"])
        else:
            args.contenders = list(CONTENDERS)
    if args.steps is None:
        args.steps = 4 if quick else 20
    if args.warmup is None:
        args.warmup = 1 if quick else 3
    if args.json is None:
        args.json = (Path("out/benchmarks_decode_quick.json") if quick
                     else DOCS / "benchmarks_decode.json")
    if args.plot_dir is None:
        args.plot_dir = Path("out") if quick else DOCS
    check_contenders(args.contenders)
    if any(is_openvino(c) for c in args.contenders):
        try:
            openvino_python()
        except RuntimeError as e:
            parser.error(str(e))
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if any(c < 2 for c in args.contexts + args.random_contexts) or any(b < 1 for b in args.batches):
        parser.error("contexts must be >= 2 tokens and batches >= 1")
    return args


def _result(args, argv, info, bandwidth, started, rows, complete: bool,
            references: dict | None = None) -> dict:
    command = "python -m benchmarks.decode " + " ".join(sys.argv[1:] if argv is None else argv)
    return {
        "command": command.strip(), "complete": complete, "machine": info,
        "copy_bandwidth_bytes_per_s": bandwidth, "model": args.model, "steps": args.steps,
        "warmup": args.warmup, "contenders": args.contenders,
        "fresh_inductor_cache": not args.keep_compile_cache,
        "seconds_total": time.time() - started,
        "load_average_at_save": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "notes": [
            "batch rows share one prompt: prefill runs once per context at batch 1 (hf-eager, "
            "SDPA) and its KV is copied into every contender's cache and row",
            "weights=random: a random-weight model of SmolLM2's shape; decode speed does not "
            "depend on weight values; KV filled with random values, no prefill",
            "first_step_s includes compilation for compiled contenders: inductor and dynamo "
            "compile at the first shape and recompile (automatic dynamic shapes) when the "
            "batch or cache length first changes",
            "floor_ms = (weight bytes + KV bytes the step must read) / copy bandwidth",
            f"agree_*: greedy agreement over the first {AGREE_TOKENS} generated tokens with "
            "references[weights/ctx] (agree_reference hf-eager-fp32: Hugging Face eager fp32 "
            "greedy decoding from the same prefill; token 0 is the prefill's, shared by our "
            "contenders); agree_first_diff: index of the first differing token (null: none)",
            "openvino-*: OpenVINO GenAI LLMPipeline (benchmarks/openvino_peer.py in "
            ".venv-openvino), "
            "same prompt token ids, batch 1, its own prefill: prefill_s = its first-token time "
            "(load excluded: openvino.load_s), peak_rss_bytes = its process's peak (load "
            "included), kv_bytes not measured, floor at its applied weight/KV precisions; its "
            "rows sit in the fp32 group (dtype fp32), its own precisions are openvino.applied",
        ],
        "references": references or {},
        "rows": rows, "ratios": add_ratios(rows),
        "crossovers": [c for name in args.contenders if name.startswith("specontext")
                       for c in crossovers(rows, name)],
    }


def main(argv=None) -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    args = parse_args(argv)
    # Every contender compiles the same ``forward`` code object, and dynamo keeps at most
    # ``recompile_limit`` (8) graphs per code object: past it, it silently runs the frame
    # uncompiled (dense eager with the contender's cache). Seven contenders at two shapes
    # pass 8, so the harness lifts the limit for its own process.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    if args.table_from is not None:
        result = json.loads(args.table_from.read_text())
        rows = result["rows"]
        add_ratios(rows)
        if not args.no_plots:
            write_plots(rows, args.plot_dir, args.table_from.stem)
        print(format_table(rows))
        print(format_crossovers(rows))
        print(f"complete: {result.get('complete')}; copy bandwidth "
              f"{result['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
              f"command: {result['command']}")
        return 0
    if not args.keep_compile_cache and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import tempfile

        # honest compile times: no inductor artefacts from earlier runs
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    from tqdm.auto import tqdm

    import specontext_compile  # noqa: F401  (registers the backend's ops)

    started = time.time()
    bandwidth = measure_copy_bandwidth(64 if args.quick else 512)
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write, best of 5)", flush=True)
    info = machine_info()

    if args.model == "tiny":
        model, tokenizer = random_model(tiny_config()), None
        groups = [Group("tiny (random weights)", "random", args.contexts, args.batches)]
    else:
        from specontext_compile.models import load_model

        model, tokenizer = load_model("smollm2-135m")
        groups = [Group("smollm2-135m (real weights)", "real", args.contexts, args.batches)]
    if args.random_contexts and args.model != "tiny":
        groups.append(Group("smollm2-135m shape, random weights", "random",
                            args.random_contexts, args.random_batches))
    groups = [g for g in groups if g.contexts]
    per_row = args.warmup + args.steps + 1
    total = (sum(len(g.contexts) * len(g.batches) for g in groups) * len(args.contenders)
             * per_row * len(args.dtypes))
    bar = None if args.no_progress else tqdm(total=total, desc="decode steps", unit="step")
    args.json.parent.mkdir(parents=True, exist_ok=True)

    references: dict[str, list[int] | None] = {}

    def save(rows, complete=False):
        result = _result(args, argv, info, bandwidth, started, rows, complete, references)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        return result

    rows: list[dict] = []
    try:
        for group in groups:
            if group.weights == "random" and args.model != "tiny":
                if bar is not None:
                    bar.write("random-weight model of SmolLM2's shape for contexts "
                              f"{group.contexts}: decode speed does not depend on weight values "
                              "(KV filled with random values, no prefill)")
                model = random_like(model, max(group.contexts) + per_row + 2)
                gc.collect()
            for dtype in args.dtypes:
                typed = model if DTYPES[dtype] == torch.float32 else copy.deepcopy(model).to(DTYPES[dtype])
                run_group(typed, tokenizer if group.weights == "real" else None, group,
                          args.contenders, args.steps, args.warmup, bandwidth, bar, rows, save,
                          references, reference_model=model)
                del typed
                gc.collect()
    finally:
        if bar is not None:
            bar.close()
    result = save(rows, complete=True)
    plots = [] if args.no_plots else write_plots(rows, args.plot_dir, args.json.stem)  # plot named as its JSON
    print(format_table(rows))
    print(format_crossovers(rows))
    if any(r["weights"] == "random" for r in rows):
        print("weights=random rows: random-weight model (decode speed does not depend on "
              "weight values)")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; total {result['seconds_total']:.0f} s; "
          f"JSON: {args.json}" + (f"; plots: {', '.join(plots)}" if plots else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
