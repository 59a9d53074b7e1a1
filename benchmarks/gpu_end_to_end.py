"""End-to-end decode throughput on one GPU: dense SDPA / FlexAttention vs specontext.

A random-weight model of Llama-3-8B's shape (32 layers, 32 query / 8 KV heads, head_dim
128, hidden 4096, MLP 14336, vocab 128256; no download, decode speed does not depend on
weight values) in bf16. Workloads are ``[input, output]`` pairs such as ``[2k, 16k]`` and
``[2k, 32k]``: generating all output tokens would take too long, so each workload is
truncated to a window of ``--window`` decode steps timed at the end of the generation
(KV length ``input + output - window``), with the KV cache filled with random values
instead of a prefill. For every workload and batch size (1..32) and every contender:

* ``sdpa``: Hugging Face eager decoding with a ``StaticCache`` and dense SDPA;
* ``flex``: the same with ``attn_implementation="flex_attention"`` (when available);
* ``specontext``: ``torch.compile(model.forward, backend="specontext", budget=2048)`` with a
  ``SpeContextCache`` (generated Triton kernels on CUDA);
* ``sdpa-cudagraphs``: the dense ``StaticCache`` + SDPA model compiled by inductor with CUDA
  graphs (``mode="reduce-overhead"``, Hugging Face's default compile mode);
* ``specontext-eager``: the op chain run one op at a time (``inner="eager", lower=False``:
  the state before issue 11); ``specontext`` is the default (lowered ops compiled by inductor);
  ``specontext-cudagraphs`` adds CUDA graphs (``mode="reduce-overhead"``);
* ``specontext-torch-kernel`` (``-cudagraphs``): the same with ``kernel="torch"``, i.e. the
  attention as inductor's own gather kernels instead of the generated kernel (issue 27, item 6);

it reports the median decode ms/step (CUDA-synchronised wall time), tokens/s
(``batch * 1000 / ms``), the peak device memory and the KV bytes held. Configurations whose
KV cache would not fit in free device memory are skipped with the reason; once
``--time-budget`` seconds have passed the rest are skipped too, so one call stays under
8 minutes. The table is printed last.

    python benchmarks/gpu_end_to_end.py                     # on a CUDA machine
    python benchmarks/gpu_end_to_end.py --dry-run           # tiny shapes on CPU
    python benchmarks/gpu_end_to_end.py --batches 1 8 32 --json out/gpu_e2e.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
    max_position_embeddings=131072, tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _positive_pair(text: str, what: str, form: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B), both ints >= 1, else an argparse error naming ``what`` and ``form``."""
    try:
        first, second = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} {text!r} is not {form}") from None
    if first < 1 or second < 1:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: both sides must be >= 1")
    return first, second


def parse_workload(text: str) -> tuple[int, int]:
    """``"2048:16384"`` -> (input tokens, output tokens)."""
    return _positive_pair(text, "workload", "INPUT:OUTPUT")


def parse_shape(text: str) -> tuple[int, int]:
    """``"32752:8"`` -> (KV length at the timed steps, batch)."""
    return _positive_pair(text, "shape", "CONTEXT:BATCH")


def parse_args(argv=None) -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_end_to_end.py", description=doc[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n\n".join(doc[1:]))
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny model and shapes on CPU (exercises the script, no GPU)")
    parser.add_argument("--workloads", type=parse_workload, nargs="+", default=None,
                        help="INPUT:OUTPUT token pairs (default 2048:16384 2048:32768)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes (default 1 4 8 16 32)")
    parser.add_argument("--contenders", nargs="+", default=["sdpa", "flex", "specontext"],
                        choices=["sdpa", "flex", "sdpa-cudagraphs", *SPECONTEXT_VARIANTS])
    parser.add_argument("--budget", type=int, default=None, help="specontext budget (2048)")
    parser.add_argument("--window", type=int, default=None, help="timed decode steps (16)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (3)")
    parser.add_argument("--time-budget", type=float, default=420.0,
                        help="seconds after which remaining configurations are skipped")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default 32, Llama-3-8B's; fewer compile faster: the "
                             "per-layer work is the same, the embedding and LM head weigh more)")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=None,
                        help="CONTEXT:BATCH pairs timed in this order (instead of --workloads x --batches): "
                             "KV length at the timed steps and batch size, e.g. 130032:1 32752:8")
    parser.add_argument("--retrieval-layers", type=int, nargs="+", default=None,
                        help="specontext's retrieval layers (default: the 32-layer model's default picks "
                             "that exist among --layers, i.e. a truncation of the whole model with its "
                             "default options; (2, 4) of 8 layers, the share 8 of 32 reads)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    dry = args.dry_run
    default_workloads = [(32, 96), (32, 160)] if dry else [(2048, 16384), (2048, 32768)]
    args.workloads = args.workloads or default_workloads
    args.batches = args.batches or ([1, 2] if dry else [1, 4, 8, 16, 32])
    args.budget = args.budget if args.budget is not None else (64 if dry else 2048)
    args.window = args.window if args.window is not None else (3 if dry else 16)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 3)
    if any(b < 1 for b in args.batches) or args.window < 1 or args.budget < 1:
        parser.error("batches, --window and --budget must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0 (the first, compiling step is never timed)")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    layers = args.layers or (TINY if dry else LLAMA3_8B)["num_hidden_layers"]
    if args.retrieval_layers and not all(0 <= i < layers for i in args.retrieval_layers):
        parser.error(f"--retrieval-layers must name layers 0..{layers - 1} of the {layers}-layer model")
    if args.json is not None and args.json.is_dir():
        parser.error(f"--json {args.json} is a folder: give a file path")
    args.cases = cases(args)
    return args


def cases(args) -> list[tuple[int | None, int | None, int, int]]:
    """``(input, output, context, batch)`` in timing order: ``--shapes`` as given, else every
    workload with every batch (context ``input + output - window``)."""
    if args.shapes:
        return [(None, None, context, batch) for context, batch in args.shapes]
    return [(inp, out, inp + out - args.window, batch)
            for inp, out in args.workloads for batch in args.batches]


def retrieval_layers(args, num_layers: int) -> tuple[int, ...]:
    """The retrieval layers specontext's rows use (see ``--retrieval-layers``)."""
    from specontext_compile.config import default_retrieval_layers

    if args.retrieval_layers:
        return tuple(args.retrieval_layers)
    picks = tuple(i for i in default_retrieval_layers(LLAMA3_8B["num_hidden_layers"]) if i < num_layers)
    return picks or default_retrieval_layers(num_layers)


def build_model(dry: bool, device: torch.device, dtype: torch.dtype, attn: str, layers: int | None = None):
    """Random-weight Llama of Llama-3-8B's shape (or tiny), built directly on ``device``;
    ``layers`` decoder layers when given."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(TINY if dry else LLAMA3_8B)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(**shape, attn_implementation=attn)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def kv_bytes_needed(config, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a K+V cache of ``tokens`` positions for every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (2 * config.num_hidden_layers * batch * config.num_key_value_heads * tokens
            * config.head_dim * elem)


def weight_bytes(model) -> int:
    """Parameter bytes one decode step reads: all but the input embedding (one row each)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


def kv_read_bytes(config, name: str, batch: int, context: int, budget: int, retrieval: int,
                  elem: int, page_tokens: int = 16) -> int:
    """The fewest KV bytes one decode step of contender ``name`` must read (its floor).

    Dense: every key and value of every layer. specontext's default step (docs/design.md):
    the selection reads the keys of its ``retrieval`` layers over the whole context; each
    layer reads its page bounds (min and max per ``page_tokens`` keys), the keys of its
    ``budget + page_rescue`` candidates (``page_rescue = 2 * budget``, the default) to refine
    them, and the keys and values of the ``budget`` it keeps."""
    row = batch * config.num_key_value_heads * config.head_dim * elem  # one token's key, all rows
    layers = config.num_hidden_layers
    if not name.startswith("specontext"):
        return 2 * layers * context * row
    kept = min(budget, context)
    candidates = min(3 * budget, context)
    bounds = 2 * -(-context // page_tokens)
    return retrieval * context * row + layers * (bounds + candidates + 2 * kept) * row


def copy_bandwidth(device) -> float | None:
    """Device memory bandwidth in bytes/s (bytes read + written by a 1 GiB copy, best of 5)."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000.0)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / best


def fill_random(cache, config, batch: int, tokens: int, device, dtype) -> None:
    """Write ``tokens`` random key/value positions into every layer of ``cache``."""
    shape = (batch, config.num_key_value_heads, tokens, config.head_dim)
    for layer in range(config.num_hidden_layers):
        k = torch.randn(shape, device=device, dtype=dtype)
        v = torch.randn(shape, device=device, dtype=dtype)
        cache.update(k, v, layer)
        del k, v


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SPECONTEXT_VARIANTS = {
    "specontext": {},
    "specontext-eager": {"inner": "eager", "lower": False},
    "specontext-inductor": {"inner": "inductor"},
    "specontext-cudagraphs": {"mode": "reduce-overhead"},
    # the compiled step with inductor's own gather kernels instead of the generated one (before issue 27, item 6)
    "specontext-torch-kernel": {"kernel": "torch"},
    "specontext-torch-kernel-cudagraphs": {"kernel": "torch", "mode": "reduce-overhead"},
}


def run_one(name, model, forward, args, batch, context, device, dtype) -> dict:
    """Time ``warmup + window`` decode steps of one contender at one shape."""
    from transformers import StaticCache

    import specontext_compile as sc

    capacity = context + args.warmup + args.window + 2
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if name.startswith("specontext"):
        cache = sc.SpeContextCache(model.config, max_cache_len=capacity)
    else:
        cache = StaticCache(model.config, max_cache_len=capacity)
    fill_random(cache, model.config, batch, context, device, dtype)
    token = torch.ones((batch, 1), dtype=torch.long, device=device)
    times = []
    with torch.no_grad():
        t_first = time.perf_counter()
        for i in range(1 + args.warmup + args.window):
            _sync(device)
            t0 = time.perf_counter()
            out = forward(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            if i == 0:
                first = time.perf_counter() - t_first
            elif i > args.warmup:
                times.append(time.perf_counter() - t0)
    ms = 1000.0 * statistics.median(times)
    kv = sum(t.numel() * t.element_size() for layer in cache.layers
             for t in (layer.keys, layer.values))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del cache, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ms_median": ms, "ms_min": 1000.0 * min(times), "ms_max": 1000.0 * max(times),
            "tokens_per_s": batch * 1000.0 / ms, "first_step_s": first, "kv_bytes": kv,
            "peak_device_bytes": peak}


def _sites_rewritten() -> str | None:
    """``"rewritten/total"`` attention sites of the latest specontext decode graph."""
    from specontext_compile import compile_reports

    decode = [r for r in compile_reports() if r.result.phase == "decode"]
    return f"{decode[-1].sites_rewritten}/{decode[-1].sites_total}" if decode else None


def _kernel_sites() -> int:
    """Sites the lowering sent to the generated kernel so far (runtime/kernel_step.py)."""
    from torch._dynamo.utils import counters

    return counters["specontext"]["kernel_sites_lowered"]


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def _kernel_fallbacks() -> int:
    from torch._dynamo.utils import counters

    return counters["specontext"]["kernel_compile_fallbacks"]


def flex_available() -> str | None:
    """None when FlexAttention can be used, else why not."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as err:
        return f"FlexAttention not importable: {err}"
    return None


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    """Rows as a Markdown table: each row's speed-up against the strongest dense row of its shape
    (``sdpa-cudagraphs`` where it ran, else ``sdpa``) and the share of its floor it reaches."""
    base = {}
    for ref in ("sdpa", "sdpa-cudagraphs"):  # the strongest dense row we have: CUDA graphs when run
        base.update({(r["context"], r["batch"]): (ref, r["ms_median"])
                     for r in rows if r["contender"] == ref and r.get("ms_median")})
    lines = ["| KV len | batch | contender | ms/step | floor ms | floor share | tok/s | vs dense | "
             "first step s | KV GB | peak mem GB | note |", "|" + "---|" * 12]
    for r in rows:
        ms = r.get("ms_median")
        ref_name, ref = base.get((r["context"], r["batch"]), (None, None))
        peak = r.get("peak_device_bytes")
        floor = r.get("floor_ms")
        cells = [
            str(r["context"]), str(r["batch"]), r["contender"],
            _num(ms, ".2f"), _num(floor, ".2f"), _num(floor / ms if ms and floor else None, ".2f"),
            _num(r.get("tokens_per_s"), ".0f"),
            f"{ref / ms:.2f} ({ref_name})" if ms and ref else "-", _num(r.get("first_step_s"), ".1f"),
            _num(r["kv_bytes"] / 1e9 if "kv_bytes" in r else None, ".2f"),
            _num(peak / 1e9 if peak else None, ".1f"), r.get("note", ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the end-to-end GPU benchmark (see the module docstring)."""
    args = parse_args(argv)
    # contenders share the model's forward code object; past dynamo's recompile limit (8
    # graphs) it would silently run them uncompiled (see benchmarks/decode.py)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    started = time.time()
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            print("gpu_end_to_end: no CUDA device; use --dry-run to exercise the script on CPU",
                  file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
    import specontext_compile  # noqa: F401  (registers the backend and its ops)

    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"random weights ({'tiny' if args.dry_run else 'Llama-3-8B shape'}"
          f"{f', {args.layers} layers' if args.layers else ''}), {dtype}; "
          "decode speed does not depend on weight values; KV filled with random values",
          flush=True)
    model = build_model(args.dry_run, device, dtype, "sdpa", args.layers)
    config = model.config
    forwards = {"sdpa": model.forward}
    flex_reason = flex_available() if "flex" in args.contenders else None
    if args.dry_run and "flex" in args.contenders:
        flex_reason = "skipped in --dry-run (FlexAttention compiles per shape)"
    retrieval = retrieval_layers(args, config.num_hidden_layers)
    bandwidth = copy_bandwidth(device)
    weights = weight_bytes(model)
    meta = {"retrieval_layers": list(retrieval), "copy_bytes_per_s": bandwidth, "weight_bytes": weights,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__}
    if bandwidth:
        print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); weights read per step "
              f"{weights / 1e9:.2f} GB; specontext retrieval layers {retrieval}", flush=True)
    elem = torch.empty((), dtype=dtype).element_size()
    rows: list[dict] = []
    for inp, out, context, batch in args.cases:
        for name in args.contenders:
            row = {"input": inp, "output": out, "context": context, "batch": batch,
                   "contender": name,
                   "budget": args.budget if name.startswith("specontext") else None}
            row["kv_read_bytes"] = kv_read_bytes(config, name, batch, context, args.budget,
                                                 len(retrieval), elem)
            if bandwidth:  # the step's floor: its bytes at the copy rate
                row["floor_ms"] = 1000.0 * (weights + row["kv_read_bytes"]) / bandwidth
            rows.append(row)
            need = kv_bytes_needed(config, batch, context + args.window + 8, dtype)
            if time.time() - started > args.time_budget:
                row["note"] = "skipped: time budget spent"
                continue
            if name == "flex" and flex_reason:
                row["note"] = flex_reason
                continue
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                if need > 0.9 * free:
                    row["note"] = f"skipped: KV {need / 1e9:.0f} GB > free {free / 1e9:.0f} GB"
                    continue
            try:
                if name not in forwards:
                    if name == "flex":
                        model.set_attn_implementation("flex_attention")
                        forwards[name] = model.forward
                    elif name == "sdpa-cudagraphs":
                        forwards[name] = torch.compile(model.forward, mode="reduce-overhead")
                    else:
                        forwards[name] = torch.compile(
                            model.forward, backend="specontext",
                            options={"budget": args.budget, "retrieval_layers": retrieval,
                                     **SPECONTEXT_VARIANTS[name]})
                if name == "flex":
                    model.set_attn_implementation("flex_attention")
                else:
                    model.set_attn_implementation("sdpa")
                lowered_before, skips_before = _kernel_sites(), _cudagraph_skips()
                row.update(run_one(name, model, forwards[name], args, batch, context,
                                   device, dtype))
                if name.endswith("cudagraphs"):  # 0: CUDA graphs really replayed the step
                    row["cudagraph_skips"] = _cudagraph_skips() - skips_before
                if name.startswith("specontext"):
                    row["sites_rewritten"] = _sites_rewritten()
                    row["kernel_sites_lowered"] = _kernel_sites() - lowered_before  # compiled in this row
                    row["kernel_compile_fallbacks"] = _kernel_fallbacks()  # since the run began
            except Exception as err:  # a contender failing must not lose the table
                first_line = (str(err).splitlines() or [""])[0][:120]
                row["note"] = f"error: {type(err).__name__}: {first_line}"
            if "note" in row:  # free what the failed attempt held (after its traceback)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            floor = f" (floor {row['floor_ms']:.2f})" if "floor_ms" in row else ""
            print(f"[{time.time() - started:5.0f} s] KV {context} batch {batch} {name}: "
                  + (f"{row['ms_median']:.2f} ms/step{floor}" if "ms_median" in row else row["note"]),
                  flush=True)
            _write_json(args, device, dtype, started, rows, meta)  # a killed run keeps its rows
    model.set_attn_implementation("sdpa")
    _write_json(args, device, dtype, started, rows, meta)
    print(format_table(rows))
    return 0


def _write_json(args, device, dtype, started: float, rows: list[dict], meta: dict) -> None:
    if not args.json:
        return
    result = {"device": str(device), **meta, "dtype": str(dtype), "dry_run": args.dry_run,
              "layers": args.layers or (TINY if args.dry_run else LLAMA3_8B)["num_hidden_layers"],
              "budget": args.budget, "window": args.window, "warmup": args.warmup,
              "seconds_total": time.time() - started, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
