"""vLLM dense against vLLM with the specontext plugin, side by side (issue 54, item 6).

N concurrent requests of [input, output] tokens (real text: consecutive slices of
``pydoc_data.topics``, one per request, so no prefix is shared), greedy, on SmolLM2-135M, in
vLLM's own venv (``bash scripts/vllm_venv.sh``). Each contender runs in a fresh process (one
engine each); per contender and dtype it reports:

* ``step_ms`` p50 / p10 / p90: wall time of ``engine.step()`` while every request decodes (none
  prefilling, none finished) — vLLM's time per output token at that batch;
* ``decode_tokens_per_s``: ``requests * 1000 / step_ms p50``; ``wall_tokens_per_s``: generated
  tokens over the whole run's wall time (prefills included);
* ``floor_ms``: (weights + the KV the step must read) / the copy bandwidth measured in the
  same process; dense reads every request's whole KV in every layer, the plugin the
  retrieval layers' keys once per step and ``budget`` keys and values per layer;
* ``first_diff``: per request, the first generated token that differs from the dense run of
  the same dtype (None: all equal).

Run it from the main venv (it starts the workers in ``.venv-vllm``)::

    python -m benchmarks.vllm_serving --requests 8 --input 7680 --output 512 --dtypes fp32 bf16 \
        --json docs/results/vllm_serving_8x8k.json

(SmolLM2 has 8192 positions: input + output must fit.)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("vllm_serving")

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL_DIR = ROOT / "out" / "vllm" / "smollm2-135m-hf"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
RETRIEVAL_LAYERS = 8  # the default retrieval layers of a 30-layer model (config.default_retrieval_layers)


def contender_options(name: str) -> dict | None:
    """``vllm-dense`` (no plugin options) or ``specontext-<budget>`` followed by any of
    ``-rescue<tokens>`` (option ``page_rescue``), ``-c<candidates>`` (option ``candidates``),
    ``-g<share>`` (option ``min_coverage``, the fidelity guard) and ``-ks`` (option
    ``selection_keys="store"``: the selection scores vLLM's cache, not the int8 keys of the
    default), e.g. ``specontext-1024-rescue2048``."""
    if name == "vllm-dense":
        return None
    parts = name.split("-")
    if parts[0] != "specontext" or len(parts) < 2 or not parts[1].isdigit():
        raise SystemExit(f"unknown contender {name!r}: vllm-dense or "
                         "specontext-<budget>[-rescue<tokens>][-c<candidates>][-g<min_coverage>][-ks]")
    options = {"budget": int(parts[1])}
    for part in parts[2:]:
        if part.startswith("rescue") and part[6:].isdigit():
            options["page_rescue"] = int(part[6:])
        elif part.startswith("c") and part[1:].replace(".", "", 1).isdigit():
            options["candidates"] = float(part[1:])
        elif part.startswith("g") and part[1:].replace(".", "", 1).isdigit():
            options["min_coverage"] = float(part[1:])
        elif part == "ks":
            options["selection_keys"] = "store"
        else:
            raise SystemExit(f"unknown contender {name!r}: after the budget, rescue<tokens>, c<candidates>, "
                             "g<min_coverage> or ks")
    return options


# --------------------------------------------------------------------------- worker (.venv-vllm)


def _prompts(requests: int, tokens: int) -> list[list[int]]:
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text).input_ids
    if len(ids) < requests * tokens:
        raise SystemExit(f"pydoc_data.topics has {len(ids)} tokens, fewer than {requests} x {tokens}")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(requests)]


def _copy_bandwidth() -> float:
    import torch

    src = torch.rand(128 * 2**20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def _floor_ms(config, dtype_bytes: int, requests: int, context: int, options: dict | None, weights: int,
              bandwidth: float, block_size: int = 32) -> float:
    """Weights + the KV a step must read, at ``bandwidth``: dense every token of every layer; the
    plugin the retrieval layers' keys once (their int8 copies, ``head_dim + 4`` bytes a token and
    KV head, unless ``selection_keys="store"``) and ``budget`` tokens per layer; a layer that refines
    (``page_rescue``, ``candidates > 1``) the keys of its candidates (``candidates x budget``,
    plus the rescued tokens) and the values of ``budget`` tokens, and with ``page_rescue``
    every layer's float32 block bounds (low and high)."""
    layers, kv = config.num_hidden_layers, config.num_key_value_heads
    d = config.hidden_size // config.num_attention_heads
    row = kv * d * dtype_bytes  # one token's key (or value) in one layer
    if options is None:
        kv_bytes = requests * layers * 2 * context * row
    else:
        rescue, budget = options.get("page_rescue", 0), options["budget"]
        candidates = min(math.ceil(options.get("candidates", 1) * budget) + rescue, context)
        per_layer = (candidates + min(budget, context)) * row  # keys of the candidates, values of the kept
        bounds = layers * -(-context // block_size) * kv * d * 2 * 4 if rescue else 0
        selection_row = row if options.get("selection_keys", "int8") == "store" else kv * (d + 4)
        kv_bytes = requests * (RETRIEVAL_LAYERS * context * selection_row + layers * per_layer + bounds)
    return 1000 * (weights + kv_bytes) / bandwidth


def worker(args: dict) -> dict:
    """One engine, one contender, one dtype (runs in ``.venv-vllm``)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from torch._dynamo.utils import counters
    from vllm import LLM, SamplingParams

    options = contender_options(args["contender"])
    prompts = _prompts(args["requests"], args["input"])
    t0 = time.perf_counter()
    llm = LLM(model=str(MODEL_DIR), dtype=args["dtype"], enforce_eager=args["eager"], max_model_len=args["input"]
              + args["output"], block_size=32, max_num_seqs=args["requests"], gpu_memory_utilization=0.3,
              enable_prefix_caching=False, skip_tokenizer_init=True,
              additional_config={"specontext": options} if options else {})
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=args["output"], temperature=0.0, detokenize=False, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    produced = {str(i): 0 for i in range(len(prompts))}
    tokens: dict[str, list[int]] = {}
    steps = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        all_decoding = all(n >= 1 for n in produced.values())
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        finished = False
        for o in outs:
            produced[o.request_id] = len(o.outputs[0].token_ids)
            tokens[o.request_id] = list(o.outputs[0].token_ids)
            finished |= o.finished
        if all_decoding and not finished and len(outs) == len(prompts):
            steps.append(dt * 1000)
    wall = time.perf_counter() - t0
    cfg = llm.llm_engine.model_config.hf_config
    weights = _weight_bytes(args["dtype"])
    bandwidth = _copy_bandwidth()
    steps.sort()
    quant = statistics.quantiles(steps, n=10) if len(steps) >= 10 else [steps[0]] * 9
    p50 = statistics.median(steps)
    return {
        "contender": args["contender"], "dtype": args["dtype"], "requests": args["requests"],
        "input": args["input"], "output": args["output"], "eager": args["eager"],
        "engine_start_s": round(start_s, 1), "wall_s": round(wall, 1), "decode_steps_timed": len(steps),
        "step_ms_p50": round(p50, 2), "step_ms_p10": round(quant[0], 2), "step_ms_p90": round(quant[8], 2),
        "decode_tokens_per_s": round(args["requests"] * 1000 / p50, 1),
        "wall_tokens_per_s": round(sum(len(t) for t in tokens.values()) / wall, 1),
        "floor_ms": round(_floor_ms(cfg, 4 if args["dtype"] == "float32" else 2, args["requests"], args["input"],
                                    options, weights, bandwidth), 2),
        "copy_bandwidth_gbs": round(bandwidth / 1e9, 1),
        "plugin_counters": dict(counters["specontext_vllm"]),
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
    }


def _weight_bytes(dtype: str) -> int:
    """Bytes of SmolLM2-135M's weights in ``dtype`` (tied embedding counted once)."""
    from safetensors import safe_open

    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (not a dict)
    return numel * (4 if dtype == "float32" else 2)


def _export_model() -> None:
    """SmolLM2 as an fp32 Hugging Face folder (once), in this venv."""
    if (MODEL_DIR / "config.json").exists():
        return
    from benchmarks.openvino_export import export

    export(MODEL_DIR)


# --------------------------------------------------------------------------- driver (main venv)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def prepare_driver() -> None:
    """The driver's start (main venv): logging, ``.venv-vllm`` present, SmolLM2's folder exported.

    Raises:
        SystemExit: no ``.venv-vllm`` (naming the script that makes it)."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not VENV_PYTHON.exists():
        raise SystemExit("no .venv-vllm: run `bash scripts/vllm_venv.sh` first")
    subprocess.run([str(VENV_PYTHON), "-c", "from benchmarks.vllm_serving import _export_model; _export_model()"],
                   cwd=ROOT, check=True)


def write_rows(path: Path, module: str, argv: list[str] | None, rows: list[dict]) -> None:
    """The raw JSON of a run: the command that made it, the machine, every row."""
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "python": sys.version.split()[0]}
    path.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([f"python -m {module}", *(argv or sys.argv[1:])])
    path.write_text(json.dumps({"command": command, "machine": machine, "rows": rows}, indent=1))


def _run(args, contender: str, dtype: str) -> dict:
    job = {"contender": contender, "dtype": DTYPES[dtype], "requests": args.requests, "input": args.input,
           "output": args.output, "eager": args.eager}
    cmd = [str(VENV_PYTHON), "-m", "benchmarks.vllm_serving", "--worker", json.dumps(job)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{contender} {dtype} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--input", type=int, default=8192)
    parser.add_argument("--output", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--contenders", nargs="+", default=["vllm-dense", "specontext-1024"])
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True (no vLLM compile)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per contender")
    parser.add_argument("--json", type=Path, help="write every row (tokens included) here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _export_model()
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    prepare_driver()
    rows = []
    for dtype in args.dtypes:
        dense = None
        for contender in args.contenders:
            logger.info("%s %s ...", contender, dtype)
            row = _run(args, contender, dtype)
            if contender == "vllm-dense":
                dense = row
            row["first_diff"] = None if dense is None or dense is row else [
                _first_diff(a, b) for a, b in zip(row["tokens"], dense["tokens"])]
            rows.append(row)
            logger.info("%s %s: %.1f ms/step p50 (floor %.1f), %.1f tok/s decode, %.1f tok/s wall", contender,
                        dtype, row["step_ms_p50"], row["floor_ms"], row["decode_tokens_per_s"], row["wall_tokens_per_s"])
    for dtype in args.dtypes:
        base = next((r for r in rows if r["dtype"] == DTYPES[dtype] and r["contender"] == "vllm-dense"), None)
        for r in rows:
            if r["dtype"] == DTYPES[dtype] and base is not None:
                r["speedup_vs_dense"] = round(base["step_ms_p50"] / r["step_ms_p50"], 3)
    print("| contender | dtype | step ms p50 [p10-p90] | floor ms | decode tok/s | wall tok/s | vs dense | first diff |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['contender']} | {r['dtype']} | {r['step_ms_p50']} [{r['step_ms_p10']}-{r['step_ms_p90']}] | "
              f"{r['floor_ms']} | {r['decode_tokens_per_s']} | {r['wall_tokens_per_s']} | "
              f"{r.get('speedup_vs_dense', '')} | {r['first_diff']} |")
    if args.json:
        write_rows(args.json, "benchmarks.vllm_serving", argv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
