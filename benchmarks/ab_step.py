"""A/B of two bodies of the compiled decode step in one process, steps interleaved.

Profiles of separate processes on a 2-core machine move by 10-20% from run to run, more than
the changes measured here. This compiles SmolLM2-135M's decode step twice (same options, same
random KV of ``--context`` tokens, each with its own cache): ``A``, the current code, and
``B``, the same code with one trace-time name swapped (``--swap``):

* ``sdpa``: the dense shortcut keeps SDPA (``aten_step.fused_products`` returns False) at
  the sites the pass left off our CPU kernel (``StepSpec.cpu_kernel`` False);
* ``unsplit``: the dense shortcut keeps the fused products over every slot, not the split
  store attention (``aten_step.split_chunks`` returns 1);
* ``unchunked``: fused query-key products (the refinement's, the gather path's) keep one
  loop over their keys (``sparse_attention.product_chunks`` returns 1);
* ``unrealized``: a fused product's logits are not written to a buffer before the softmax
  and the ranking read them (``sparse_attention.logits_once`` returns them as they are);
* ``cpp-wrapper``: inductor's C++ wrapper instead of its Python one (with ``--options
  '{"regional": false}'``: torch 2.13 cannot compile ``invoke_subgraph`` with it);
* ``no-cpu-kernel``: the dense decode attention of a float32 store keeps inductor's body
  (``split_store.py``) instead of our CPU kernel (``cpu_kernels.applies``, which the pass asks,
  returns False);
* ``no-refine-kernel``: a refined site (the default's) keeps inductor's body of
  ``aten_step.refine_and_attend`` instead of our CPU kernel (``cpu_refine.applies`` returns False);
* ``no-selection-kernel``: the lagged-query selection keeps inductor's body of
  ``scorers.lagged_query_score`` instead of our CPU kernel (``cpu_selection.applies`` returns False);
* ``selection``: a step whose sites all take the dense shortcut still makes the selection
  (``SparseAttentionPass._selection_unused`` returns False: the code before issue 51 left it out).
* ``no-gemv-kernel``: a one-row bfloat16 linear keeps inductor's reduction instead of our kernel
  (``cpu_gemv.applies`` returns False);
* ``unshared-rows``: the bf16 linears of one input row (query, key and value; gate and up) keep
  a kernel call each instead of one (``passes.gemv._share_row`` does nothing);
* ``no-stack-room``: the compiled step is called directly, not through the frame that gives its
  Python a fresh data-stack chunk (``stack_room.with_stack_room`` returns the step itself).

Or ``--options-b``: ``B`` is the same code compiled with these backend options added (an
options A/B, e.g. ``'{"mode": "max-autotune", "gemv": false}'``: inductor's CPP GEMM template).
Or ``--guard-filter-b NAME``: ``B`` is compiled with ``torch.compile``'s ``guard_filter_fn``
set to ``torch.compiler.NAME`` (e.g. ``skip_guard_on_all_nn_modules_unsafe``: dynamo stops
checking the model's modules and parameters before each step).

Inductor's and AOTAutograd's caches are off (both compiles have the same sources), each variant
is compiled from a code object of its own (dynamo's cache is per code object), then the two
steps alternate ``--steps`` times; medians and the ratio go to stdout and ``--json``.

    python -m benchmarks.ab_step --swap selection --context 8192 --budget 16384 --steps 40 --json docs/results/ab_dense_step_selection_8k_2026-12-05.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SWAPS = {  # name: (module or class path, attribute, stand-in)
    "sdpa": ("specontext_compile.runtime.aten_step", "fused_products", lambda *a, **k: False),
    "unsplit": ("specontext_compile.runtime.aten_step", "split_chunks", lambda *a, **k: 1),
    "unchunked": ("specontext_compile.runtime.sparse_attention", "product_chunks", lambda *a, **k: 1),
    "unrealized": ("specontext_compile.runtime.sparse_attention", "logits_once", lambda logits, rows, keys: logits),
    "cpp-wrapper": ("torch._inductor.config", "cpp_wrapper", True),
    "no-cpu-kernel": ("specontext_compile.runtime.cpu_kernels", "applies", lambda *a, **k: False),
    "no-refine-kernel": ("specontext_compile.runtime.cpu_refine", "applies", lambda *a, **k: False),
    "no-selection-kernel": ("specontext_compile.runtime.cpu_selection", "applies", lambda *a, **k: False),
    "selection": ("specontext_compile.passes.sparse_rewrite:SparseAttentionPass", "_selection_unused", lambda *a, **k: False),
    "no-gemv-kernel": ("specontext_compile.runtime.cpu_gemv", "applies", lambda *a, **k: False),
    "unshared-rows": ("specontext_compile.passes.gemv", "_share_row", lambda *a, **k: None),
    "no-stack-room": ("specontext_compile.stack_room", "with_stack_room", lambda fn: fn),
}


def _owner(path: str):
    """The module (``pkg.mod``) or class (``pkg.mod:Class``) a swap changes."""
    import importlib

    module, _, cls = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, cls) if cls else owner


def _own_frame(model, name: str):
    """``model.forward`` behind a function whose code object is this variant's own: dynamo
    caches compiled code per code object, so two ``torch.compile(model.forward)`` would share
    (and run) one variant's graphs."""
    namespace: dict = {}
    exec(f"def step_{name}(**kwargs):\n    return model(**kwargs)\n", {"model": model}, namespace)
    return namespace[f"step_{name}"]


def _compiled(model, args, swap, name: str):
    """A compiled forward and a filled cache; ``swap`` (an entry of :data:`SWAPS`) applies
    while the first steps trace."""
    import specontext_compile as sc
    from benchmarks.decode import fill_cache, random_source

    cache = sc.SpeContextCache(model.config, max_cache_len=args.context + 2 * args.steps + 16)
    options = {"budget": args.budget, **args.options, **(args.options_b if name == "b" else {})}
    if name == "b" and args.guard_filter_b:  # torch.compile takes it out of the options
        options["guard_filter_fn"] = getattr(torch.compiler, args.guard_filter_b)
    forward = torch.compile(_own_frame(model, name), backend="specontext", options=options)
    saved = owner = None
    if swap is not None:
        owner = _owner(swap[0])
        saved = getattr(owner, swap[1])
        setattr(owner, swap[1], swap[2])
    try:
        with torch.no_grad():
            source = [(k.to(model.dtype), v.to(model.dtype)) for k, v in random_source(model.config, args.context, seed=0)]
            fill_cache(cache, source, 1)
            token = torch.tensor([[1]])
            for _ in range(3):  # compile and warm
                token = forward(input_ids=token, cache=cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    finally:
        if owner is not None:
            setattr(owner, swap[1], saved)
    return forward, cache, token


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--swap", choices=sorted(SWAPS), default=None)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the model's and the KV's dtype")
    parser.add_argument("--options", type=json.loads, default={},
                        help='more backend options for both variants, as JSON (e.g. \'{"page_rescue": 0}\')')
    parser.add_argument("--options-b", type=json.loads, default={},
                        help="backend options for B only, as JSON (an options A/B; --swap may then be left out)")
    parser.add_argument("--guard-filter-b", default=None,
                        choices=("skip_guard_on_all_nn_modules_unsafe", "skip_guard_on_inbuilt_nn_modules_unsafe",
                                 "keep_tensor_guards_unsafe"),
                        help="B compiled with torch.compile's guard_filter_fn = torch.compiler.<this>")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.swap is None and not args.options_b and not args.guard_filter_b:
        parser.error("give --swap, --options-b, --guard-filter-b, or several")

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from benchmarks.decode import machine_info
    from specontext_compile.models import load_model

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    model, _ = load_model("smollm2-135m", getattr(torch, args.dtype))
    runs = {"A": _compiled(model, args, None, "a")}
    runs["B"] = _compiled(model, args, SWAPS[args.swap] if args.swap else None, "b")
    times = {"A": [], "B": []}
    with torch.no_grad():
        for _ in range(args.steps):
            for name, (forward, cache, token) in runs.items():
                start = time.perf_counter()
                token = forward(input_ids=token, cache=cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
                times[name].append(1000.0 * (time.perf_counter() - start))
                runs[name] = (forward, cache, token)
    result = {"swap": args.swap, "dtype": args.dtype, "context": args.context, "budget": args.budget, "options": args.options,
              "options_b": args.options_b, "guard_filter_b": args.guard_filter_b, "steps": args.steps,
              "threads": torch.get_num_threads(), "machine": machine_info(),
              "ms_per_step": {k: statistics.median(v) for k, v in times.items()}, "raw_ms": times,
              "command": "python -m benchmarks.ab_step " + " ".join(sys.argv[1:] if argv is None else argv)}
    result["b_over_a"] = result["ms_per_step"]["B"] / result["ms_per_step"]["A"]
    label = " + ".join(filter(None, [args.swap, json.dumps(args.options_b) if args.options_b else "",
                                     args.guard_filter_b or ""]))
    print(f"A (current) {result['ms_per_step']['A']:.2f} ms/step, B ({label}) "
          f"{result['ms_per_step']['B']:.2f} ms/step, B/A {result['b_over_a']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
