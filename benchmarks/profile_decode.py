"""Where the time of one specontext decode step goes (torch.profiler, CPU).

Prefills SmolLM2-135M (or the tiny random model) with ``--context`` tokens of real text,
copies the KV into a ``SpeContextCache``, compiles ``model.forward`` with
``backend="specontext"`` at ``--budget``, warms up, then profiles ``--steps`` decode steps.
Every operator called directly by the step is put in one bucket:

* ``sparse attention`` (``specontext::sparse_attention``), split into its gathers
  (``index_select``), the two matmuls, softmax, masks and the rest,
* ``KV write`` / ``record query``, the weight matmuls by role (Q/K/V/O projections, MLP,
  LM head), norms, rotary embedding and the rest,
* ``python/framework``: step wall time minus the time inside operators (dynamo guards,
  the FX graph's Python, HF's Python, dispatch between ops), also shown per layer.

    python -m benchmarks.profile_decode --context 8192 --budget 1024 --steps 5
    python -m benchmarks.profile_decode --dense      # the same for HF eager dense decoding
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

import torch

from benchmarks.decode import (fill_cache, kv_layout, prefill_source, random_model,
                               random_source, real_text_ids, tiny_config)

ATTENTION_PARTS = {
    "aten::index_select": "gathers (index_select)", "aten::matmul": "matmuls (QK, PV)",
    "aten::bmm": "matmuls (QK, PV)", "aten::softmax": "softmax", "aten::_softmax": "softmax",
    "aten::gather": "masks", "aten::masked_fill": "masks", "aten::ge": "masks",
    "aten::le": "masks", "aten::__and__": "masks", "aten::bitwise_and": "masks",
    "aten::add": "masks", "aten::lt": "masks",
}


def _linear_role(event, config) -> str:
    """Classify an ``aten::linear`` by its weight shape."""
    shapes = getattr(event, "input_shapes", None) or []
    weight = shapes[1] if len(shapes) > 1 else []
    if len(weight) != 2:
        return "weights: other linear"
    out_dim, in_dim = weight
    if out_dim == config.vocab_size:
        return "weights: LM head"
    if config.intermediate_size in (out_dim, in_dim):
        return "weights: MLP (gate/up/down)"
    return "weights: Q/K/V/O projections"


def _kernel_name(name: str) -> str | None:
    """An inductor C++ kernel's name without its graph prefix (``graph_<n>_cpp_fused_...``
    in a graph's own code, ``cpp_fused_...`` in a region's subgraph), or None."""
    match = _KERNEL.match(name)
    return name[match.end(1) if match.group(1) else 0:] if match else None


_KERNEL = re.compile(r"^(graph_\d+_)?cpp_")


def _bucket(event, config) -> str:
    name = event.name
    if _kernel_name(name) is not None:
        if any(k in name for k in ("index_select", "gather", "topk", "softmax")):
            return "inductor C++ kernels: selection / attention (fused)"
        return "inductor C++ kernels: weights, norms, rotary (fused)"
    if name.startswith("specontext::sparse_attention"):
        return "sparse attention"
    if name.startswith("specontext::kv_write"):
        return "KV write"
    if name in ("aten::scaled_dot_product_attention",):
        return "dense attention (SDPA)"
    if name in ("aten::linear", "aten::mm", "aten::addmm"):
        return _linear_role(event, config)
    if name in ("aten::cat", "aten::index_copy_") and "DynamicCache" not in name:
        return "KV append / cat"
    if name in ("aten::rms_norm", "aten::pow", "aten::mean", "aten::rsqrt"):
        return "norms"
    if name in ("aten::neg", "aten::slice", "aten::cos", "aten::sin"):
        return "rotary / slicing"
    return f"other ({name})"


def profile_steps(model, forward, cache, token, steps: int):
    """Profile ``steps`` decode calls; returns (profiler, wall seconds per step)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    walls = []
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            with record_function("decode_step"):
                out = forward(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            walls.append(time.perf_counter() - t0)
    return prof, walls


def _is_op(event) -> bool:
    """An operator or a kernel: aten/our ops, and inductor's generated C++ kernels (named
    ``graph_<n>_cpp_fused_...``, or ``cpp_fused_...`` in a region's subgraph, with
    ``cpp.enable_kernel_profile``)."""
    return (event.name.startswith(("aten::", "specontext::", "mkldnn::", "mkl::", "aoti_"))
            or _kernel_name(event.name) is not None)


def _ancestors(event):
    """The profiler events ``event`` ran inside, innermost first."""
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _top_level(event) -> bool:
    """An operator inside a ``decode_step`` that no other operator called."""
    for parent in _ancestors(event):
        if _is_op(parent):
            return False
        if parent.name == "decode_step":
            return True
    return False


REGION_CALL = "## Call CompiledFxGraph "


def regions(prof, steps: int, top_kernels: int = 30) -> dict:
    """Per compiled graph (inductor's ``CompiledFxGraph``, keyed by its FX-graph cache key):
    what one decode step spends in it.

    With regional compilation a step calls one graph per region (prologue, every decoder
    layer, epilogue) and identical layers call the same graph, so this is the step's split by
    layer kind; compiled whole, it is one graph. Returns ``{"graphs": [...], "ms_in_graphs":
    float, "graph_calls_per_step": int}``; each graph: ``key`` (first 12 characters),
    ``positions`` (where in the step's call order it runs, 0-based), ``calls_per_step``,
    ``ms_per_step``, ``us_per_call`` and its ``kernels`` (the ``top_kernels`` C++ kernels
    and extern aten calls by time, ms per step: C++ kernels need ``cpp.enable_kernel_profile``)."""
    calls = [e for e in prof.events() if e.name.startswith(REGION_CALL)
             and any(p.name == "decode_step" for p in _ancestors(e))]
    calls.sort(key=lambda e: e.time_range.start)
    per_step = len(calls) // steps if steps else 0
    graphs: dict[str, dict] = {}
    for i, event in enumerate(calls):
        key = event.name[len(REGION_CALL):].rstrip(" #")[:12]
        g = graphs.setdefault(key, {"key": key, "positions": [], "calls": 0, "ms": 0.0,
                                    "kernels": collections.defaultdict(float)})
        if per_step and i < per_step:
            g["positions"].append(i)
        g["calls"] += 1
        g["ms"] += event.cpu_time_total / 1000.0
        stack = list(event.cpu_children)
        while stack:
            child = stack.pop()
            if _kernel_name(child.name) is not None:
                g["kernels"][_kernel_name(child.name)] += child.cpu_time_total / 1000.0
            elif _is_op(child):  # an extern call inductor left to aten (bmm, topk, ...)
                g["kernels"][child.name] += child.cpu_time_total / 1000.0
            else:
                stack.extend(child.cpu_children)
    out = []
    for g in graphs.values():
        kernels = sorted(g["kernels"].items(), key=lambda kv: -kv[1])[:top_kernels]
        out.append({"key": g["key"], "positions": g["positions"], "calls_per_step": g["calls"] / steps,
                    "ms_per_step": g["ms"] / steps, "us_per_call": 1000.0 * g["ms"] / g["calls"],
                    "kernels": {name: ms / steps for name, ms in kernels}})
    out.sort(key=lambda g: g["positions"][0] if g["positions"] else 1 << 30)
    return {"graphs": out, "ms_in_graphs": sum(g["ms_per_step"] for g in out),
            "graph_calls_per_step": per_step}


def breakdown(prof, config, steps: int) -> dict:
    """Per-step milliseconds by bucket, sparse attention split into parts."""
    buckets: dict[str, float] = collections.defaultdict(float)
    parts: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.Counter()
    in_ops = 0.0
    for event in prof.events():
        if not _is_op(event) or not _top_level(event):
            continue
        ms = event.cpu_time_total / 1000.0
        key = _bucket(event, config)
        buckets[key] += ms / steps
        calls[key] += 1
        in_ops += ms / steps
        if key == "sparse attention":
            stack = list(event.cpu_children)
            own = ms
            for child in stack:
                part = ATTENTION_PARTS.get(child.name, "other ops")
                parts[part] += child.cpu_time_total / 1000.0 / steps
                own -= child.cpu_time_total / 1000.0
            parts["op body outside aten (Python of the op, dispatch)"] += own / steps
    return {"buckets": dict(buckets), "calls_per_step": {k: v / steps for k, v in calls.items()},
            "sparse_attention_parts": dict(parts), "ms_in_ops": in_ops,
            "launches_per_step": sum(calls.values()) / steps}


def main(argv=None) -> int:
    """Profile and print the breakdown (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_decode",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n")[-1])
    parser.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "tiny"))
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--candidates", type=float, default=1.0,
                        help="the backend's two-stage selection (issue 12), 1 = one shared selection")
    parser.add_argument("--page-rescue", type=int, default=None,
                        help="the backend's page rescue (tokens per layer; 0 = off; default: the backend's, 2 x budget)")
    parser.add_argument("--steps", type=int, default=5, help="profiled decode steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dense", action="store_true",
                        help="profile HF eager dense decoding (DynamicCache) instead")
    parser.add_argument("--inner", default="auto", choices=("auto", "eager", "inductor"),
                        help="the backend's inner compiler (auto = inductor for decode graphs; eager "
                             "= the op chain, the 'before' of issue 11)")
    parser.add_argument("--random-kv", action="store_true",
                        help="fill the KV cache with random values instead of a prefill "
                             "(minutes faster at long contexts; step time does not depend on "
                             "the values)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's; 1 gives steadier "
                             "shares on a loaded machine)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the model's and the KV's dtype")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--trace", type=Path, default=None, help="also write a Chrome trace")
    parser.add_argument("--options", type=json.loads, default={},
                        help='more backend options as JSON, e.g. \'{"regional": false}\'')
    args = parser.parse_args(argv)

    import specontext_compile as sc
    from transformers import DynamicCache

    if args.threads:
        torch.set_num_threads(args.threads)

    if args.model == "tiny":
        model = random_model(tiny_config())
        source, first = random_source(model.config, args.context), torch.tensor([[1]])
    else:
        from specontext_compile.models import load_model

        model, tokenizer = load_model("smollm2-135m", getattr(torch, args.dtype))
        if args.random_kv:
            source, first = random_source(model.config, args.context), torch.tensor([[1]])
            source = [(k.to(model.dtype), v.to(model.dtype)) for k, v in source]
        else:
            _, source, first = prefill_source(model, real_text_ids(tokenizer, args.context))
    capacity = args.context + args.warmup + args.steps + 2
    if args.dense:
        cache, forward = DynamicCache(config=model.config), model.forward
    else:
        cache = sc.SpeContextCache(model.config, max_cache_len=capacity)
        if args.inner != "eager":
            import torch._inductor.config as inductor_config

            inductor_config.cpp.enable_kernel_profile = True  # one profiler event per C++ kernel
        forward = torch.compile(model.forward, backend="specontext",
                                options={"budget": args.budget, "inner": args.inner,
                                         "candidates": args.candidates, "page_rescue": args.page_rescue,
                                         **args.options})
    with torch.no_grad():
        fill_cache(cache, source, args.batch)
        token = first.expand(args.batch, 1).contiguous()
        for _ in range(args.warmup):
            token = forward(input_ids=token, cache=cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    prof, walls = profile_steps(model, forward, cache, token, args.steps)
    result = breakdown(prof, model.config, args.steps)
    result["regions"] = regions(prof, args.steps)
    result["options"] = args.options
    layers = kv_layout(model.config)[0]
    wall_ms = 1000.0 * sum(walls) / len(walls)
    result.update({
        "context": args.context, "batch": args.batch, "budget": None if args.dense else args.budget,
        "candidates": None if args.dense else args.candidates,
        "page_rescue": None if args.dense else args.page_rescue,
        "contender": "hf-eager" if args.dense else f"specontext-{args.inner}-{args.budget}",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(), "wall_ms_per_step": wall_ms,
        "python_framework_ms": wall_ms - result["ms_in_ops"],
        "python_framework_ms_per_layer": (wall_ms - result["ms_in_ops"]) / layers,
    })
    print(f"{result['contender']}, context {args.context}, batch {args.batch}: "
          f"{wall_ms:.1f} ms/step (profiled, {args.steps} steps), {result['launches_per_step']:.0f} "
          f"ops/kernels launched per step, host (wall - ops/kernels) "
          f"{wall_ms - result['ms_in_ops']:.1f} ms")
    for key, ms in sorted(result["buckets"].items(), key=lambda kv: -kv[1]):
        if ms >= 0.05:
            print(f"  {key:<45} {ms:7.2f} ms  ({result['calls_per_step'][key]:.0f} calls)")
    for key, ms in sorted(result["sparse_attention_parts"].items(), key=lambda kv: -kv[1]):
        print(f"    sparse attention / {key:<40} {ms:7.2f} ms")
    print(f"  {'python/framework (wall - ops)':<45} {result['python_framework_ms']:7.2f} ms "
          f"({result['python_framework_ms_per_layer']:.2f} ms per layer)")
    split = result["regions"]
    if split["graphs"]:
        print(f"  compiled graphs per step: {split['graph_calls_per_step']}, "
              f"{split['ms_in_graphs']:.1f} ms inside them, {wall_ms - split['ms_in_graphs']:.1f} ms "
              "outside (dynamo guards, the stitching and wrappers, HF's Python)")
        for g in split["graphs"]:
            where = g["positions"][:3] + (["..."] if len(g["positions"]) > 3 else [])
            print(f"    graph {g['key']} at {where}: {g['calls_per_step']:.0f} calls, "
                  f"{g['us_per_call']:.0f} us/call, {g['ms_per_step']:.2f} ms/step")
            for name, ms in g["kernels"].items():
                print(f"        {name[:70]:<70} {ms:6.2f} ms/step")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
