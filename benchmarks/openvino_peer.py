"""OpenVINO GenAI as a runnable peer of the decode benchmark: greedy generation from given token
ids with ``openvino_genai.LLMPipeline`` on the CPU, timed per token.

Runs inside ``.venv-openvino`` (``bash scripts/openvino_venv.sh``: our main venv cannot import
openvino); :mod:`benchmarks.decode` calls it as a subprocess for its ``openvino-*`` contenders.
The request is JSON, as the first argument or on stdin; the answer is one JSON line on stdout:

    echo '{"ids_file": "ids.json", "config": "fp32-dense", "max_new_tokens": 64}' | \\
        .venv-openvino/bin/python -m benchmarks.openvino_peer

Request keys: ``ids_file`` (a JSON list of prompt token ids), ``config`` (``fp32-dense``,
``default``, ``evict-<budget>``), and optionally ``model`` (the IR folder, default
``out/openvino/smollm2-135m``), ``max_new_tokens`` (64), ``threads`` (2), ``warmup`` (3).

Configs:

* ``default``: OpenVINO's CPU defaults, only the thread count set (on a CPU with bf16 it
  computes in bf16 with an 8-bit KV cache);
* ``fp32-dense``: ``INFERENCE_PRECISION_HINT=f32``, ``KV_CACHE_PRECISION=f32``, and a
  ``SchedulerConfig`` without eviction (the paged-attention path the eviction config needs, so
  the two differ only by eviction);
* ``evict-<budget>``: as ``fp32-dense`` with KV cache eviction at ``max_cache_size = budget``
  (start 32 and recent 128 tokens kept, ``NORM_SUM`` scores; sizes are multiples of the 32-token
  block). The prompt is prefilled in one chunk (dense), so the first decode step still attends
  the whole prompt; eviction starts after it.

Timing: a streamer's ``write`` stamps every token (``time.perf_counter``); ``step_ms`` are
the gaps between consecutive tokens (token 0 comes out of the prefill, so ``step_ms[0]`` is the
first decode step); ``ms_median`` etc. are over the steps after the first one and ``warmup``
more, as in :mod:`benchmarks.decode`. ``first_token_s``: from the ``generate`` call to token 0
(prefill included, pipeline load excluded: that is ``load_s``). OpenVINO's own
``perf_metrics.raw_metrics.m_durations`` (the same gaps, measured inside the pipeline) are
returned too.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

logger = logging.getLogger("openvino_peer")

MODEL = Path(__file__).resolve().parent.parent / "out" / "openvino" / "smollm2-135m"
BLOCK = 32  # the CPU plugin's KV block (tokens): eviction sizes are multiples of it
START, RECENT = 32, 128  # tokens eviction always keeps at the start and the end of the cache
DEFAULTS = {"max_new_tokens": 64, "threads": 2, "warmup": 3}


def parse_config(name: str) -> int | None:
    """Eviction budget of ``evict-<budget>``, ``None`` for ``fp32-dense`` and ``default``."""
    if name in ("fp32-dense", "default"):
        return None
    head, _, tail = name.partition("-")
    if head == "evict" and tail.isdigit() and int(tail) % BLOCK == 0 and int(tail) > START + RECENT:
        return int(tail)
    raise ValueError(f"unknown OpenVINO config {name!r}: use fp32-dense, default or evict-<budget> "
                     f"(budget a multiple of {BLOCK} above {START + RECENT})")


def device_properties(name: str, threads: int) -> dict:
    """The CPU plugin's properties for a config (no scheduler)."""
    props = {"INFERENCE_NUM_THREADS": threads}
    if name != "default":
        props.update(INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
    return props


def scheduler_config(name: str, prompt_tokens: int):
    """The ``SchedulerConfig`` of ``fp32-dense`` / ``evict-*`` (``None`` for ``default``)."""
    import openvino_genai as ov_genai

    if name == "default":
        return None
    budget = parse_config(name)
    sched = ov_genai.SchedulerConfig()
    sched.max_num_batched_tokens = prompt_tokens + BLOCK  # the prompt in one chunk: dense prefill
    sched.max_num_seqs = 1
    if budget is not None:
        sched.use_cache_eviction = True
        sched.cache_eviction_config = ov_genai.CacheEvictionConfig(
            START, RECENT, budget, ov_genai.AggregationMode.NORM_SUM)
    return sched


def applied_properties(model: Path, props: dict) -> dict:
    """What the CPU plugin resolves ``props`` to, read from the same IR compiled alone after the
    paged-attention transformation the pipeline applies (its default CPU backend; it allocates
    the KV cache with the element type of the compiled ``key_cache.*`` / ``value_cache.*``
    inputs): precision hints, KV cache precisions, those input types, threads."""
    import openvino as ov
    from openvino._offline_transformations import paged_attention_transformation

    core = ov.Core()
    ir = core.read_model(str(model / "openvino_model.xml"))
    paged_attention_transformation(ir, False, False)
    compiled = core.compile_model(ir, "CPU", props)
    out = {}
    for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "KEY_CACHE_PRECISION",
                "VALUE_CACHE_PRECISION", "INFERENCE_NUM_THREADS", "EXECUTION_MODE_HINT",
                "PERFORMANCE_HINT"):
        try:
            value = compiled.get_property(key)
        except RuntimeError:
            value = None
        out[key] = value.get_type_name() if hasattr(value, "get_type_name") else (
            None if value is None else str(value))
    for port in compiled.inputs:
        name = port.get_any_name()
        if name in ("key_cache.0", "value_cache.0"):
            out[name.split(".")[0] + "_input_type"] = str(port.get_element_type().get_type_name())
    return out


def _streamer(stamps: list[float], tokens: list[int]):
    import openvino_genai as ov_genai

    class Stamps(ov_genai.StreamerBase):
        def write(self, token):
            stamps.append(time.perf_counter())
            tokens.extend(token if isinstance(token, list) else [token])
            return ov_genai.StreamingStatus.RUNNING

        def end(self):
            pass

    return Stamps()


def generate(pipe, ids: list[int], max_new_tokens: int):
    """Greedy ``max_new_tokens`` (EOS ignored): (result, seconds to the first token, per-token
    stamps relative to the call, streamed tokens)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    config = pipe.get_generation_config()
    config.max_new_tokens, config.min_new_tokens = max_new_tokens, max_new_tokens
    config.do_sample, config.ignore_eos, config.num_beams = False, True, 1
    input_ids = np.asarray([ids], dtype=np.int64)
    inputs = ov_genai.TokenizedInputs(ov.Tensor(input_ids), ov.Tensor(np.ones_like(input_ids)))
    stamps, tokens = [], []
    t0 = time.perf_counter()
    result = pipe.generate(inputs, config, _streamer(stamps, tokens))
    return result, [s - t0 for s in stamps], tokens


def _stats(ms: list[float]) -> dict:
    if not ms:
        return {"ms_median": None}
    q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) >= 2 else [ms[0]] * 9
    return {"ms_median": statistics.median(ms), "ms_p10": q[0], "ms_p90": q[-1],
            "ms_min": min(ms), "ms_max": max(ms)}


def _peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def run(request: dict) -> dict:
    """Load the pipeline for ``request['config']`` and generate once (see the module doc)."""
    import openvino_genai as ov_genai

    req = {**DEFAULTS, **request}
    name, threads, warmup = req["config"], int(req["threads"]), int(req["warmup"])
    parse_config(name)
    model = Path(req.get("model") or MODEL)
    ids = [int(i) for i in json.loads(Path(req["ids_file"]).read_text())]
    props = device_properties(name, threads)
    sched = scheduler_config(name, len(ids))
    t0 = time.perf_counter()
    pipe = ov_genai.LLMPipeline(str(model), "CPU", **props,
                                **({"scheduler_config": sched} if sched is not None else {}))
    load_s = time.perf_counter() - t0
    result, stamps, streamed = generate(pipe, ids, int(req["max_new_tokens"]))
    tokens = [int(t) for t in result.tokens[0]]
    if streamed != tokens:
        logger.warning("streamed tokens differ from the result's tokens")
    steps_ms = [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
    raw = result.perf_metrics.raw_metrics
    return {
        "config": name, "model": str(model), "prompt_tokens": len(ids), "threads": threads,
        "load_s": load_s, "first_token_s": stamps[0] if stamps else None,
        "first_step_ms": steps_ms[0] if steps_ms else None, "warmup": warmup,
        "steps": len(steps_ms[1 + warmup:]), **_stats(steps_ms[1 + warmup:]),
        "step_ms": steps_ms, "openvino_step_ms": [d / 1000 for d in raw.m_durations],
        "openvino_ttft_s": result.perf_metrics.get_ttft().mean / 1000,
        "openvino_tpot_ms": result.perf_metrics.get_tpot().mean,
        "tokens": tokens, "properties": props,
        "scheduler_config": None if sched is None else sched.to_string(),
        "applied": applied_properties(model, props),
        "peak_rss_bytes": _peak_rss_bytes(),
        "versions": _versions(),
    }


def _versions() -> dict:
    import importlib.metadata as md

    return {n: md.version(n) for n in ("openvino", "openvino-genai", "openvino-tokenizers")}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    request = json.loads(argv[0] if argv else sys.stdin.read())
    print(json.dumps(run(request)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
