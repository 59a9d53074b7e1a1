"""Tensor-parallel worker (issue 13): generate through the specontext backend on one rank of
a ``torchrun`` job (model loaded with ``DistributedConfig(tp_plan="auto")``, the newer
spelling of ``tp_plan="auto"``; gloo on CPU) or in one process.

    python tests/_tp_worker.py build FOLDER            # save a tiny Llama (fixed seed)
    python tests/_tp_worker.py run FOLDER OUT.json     # one process (the reference)
    python -m torch.distributed.run --nproc-per-node 2 tests/_tp_worker.py run FOLDER OUT.json [--inductor]

``run`` writes, per rank (``OUT.json`` gets ``.rank{r}`` before the suffix when distributed),
for each case (full budget with the gather path forced; budget 32 over a longer prompt):
the generated tokens, ``cache.path_counts()``, the compile reports (sites rewritten per graph),
the local KV heads and every selection the decode steps made (``[batch, kv_heads, budget]``,
recorded from the eager op chain, ``inner="eager"``), and the wall time.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

PROMPT_TOKENS = 48
NEW_TOKENS = 6
# (name, backend options): full budget with the gather path, then a real selection of 32
# (4 sinks + 8 recent + 20 by score) over a 48-token prompt; both through the eager op chain
# (``inner="eager"``) so every selection can be recorded. ``budget32_inductor`` (the default
# inner compiler: ops lowered to aten and compiled by inductor) runs with ``--inductor``.
CASES = (
    ("full", {"budget": 1024, "dense_shortcut": False, "inner": "eager"}),
    # page_rescue=0: the shared selection, recorded per rank (the rescue would make it per layer)
    ("budget32", {"budget": 32, "sink_tokens": 4, "recent_window": 8, "inner": "eager", "page_rescue": 0}),
)
INDUCTOR_CASE = ("budget32_inductor", {"budget": 32, "sink_tokens": 4, "recent_window": 8, "page_rescue": 0})
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")


def build(folder: str) -> None:
    """A tiny Llama (4 query heads over 2 KV heads, 2 layers) with fixed-seed weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init: peaked, seed-specific attention
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)


def _record_selections(store: list):
    """Record every selection the eager op chain makes (``inner="eager"`` calls the op bodies)."""
    from specontext_compile.runtime import scorers

    original = scorers.head_select

    @functools.wraps(original)
    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        store.append(out.detach().clone())
        return out

    scorers.head_select = recording
    return lambda: setattr(scorers, "head_select", original)


def _collectives(graph_module: torch.fx.GraphModule) -> int:
    """Communication ops in a graph (dynamo records HF TP's all-reduces as functional ones)."""
    return sum(1 for n in graph_module.graph.nodes if n.op == "call_function"
               and getattr(n.target, "__name__", "").split(".")[0] in COLLECTIVES)


def _load(folder: str, world: int):
    from transformers import AutoModelForCausalLM

    if world == 1:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    try:
        from transformers import DistributedConfig
    except ImportError:  # older transformers: the plain argument
        return AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32)


def _rows(weight: torch.Tensor) -> int:
    return int((weight.to_local() if hasattr(weight, "to_local") else weight).shape[0])


def run(folder: str, out: str, *flags: str) -> None:
    import torch.distributed as dist

    import specontext_compile
    from specontext_compile.api import make_cache, restore
    from specontext_compile.backend import clear_compile_reports, compile_reports

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo")
    model = _load(folder, world).eval()
    config = model.config
    attn = model.model.layers[0].self_attn
    result = {"rank": rank, "world": world,
              "kv_heads": [rank * config.num_key_value_heads // world, (rank + 1) * config.num_key_value_heads // world],
              "local_q_heads": _rows(attn.q_proj.weight) // attn.head_dim,
              "local_kv_heads": _rows(attn.k_proj.weight) // attn.head_dim,
              "tp_plan": {k: v for k, v in (getattr(config, "base_model_tp_plan", None) or {}).items() if "self_attn" in k},
              "cases": {}}
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, config.vocab_size, (1, PROMPT_TOKENS), generator=g)
    cases = CASES + ((INDUCTOR_CASE,) if "--inductor" in flags else ())
    with torch.no_grad():
        t0 = time.perf_counter()
        dense = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        result["dense_tokens"] = dense[0, PROMPT_TOKENS:].tolist()
        result["dense_s"] = time.perf_counter() - t0
        for name, options in cases:
            torch._dynamo.reset()
            clear_compile_reports()
            specontext_compile.compile(model, **options)
            selections: list[torch.Tensor] = []
            undo = _record_selections(selections) if options.get("inner") == "eager" else (lambda: None)
            cache = make_cache(model, prompt, NEW_TOKENS)
            t0 = time.perf_counter()
            try:
                tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache)
            finally:
                undo()
            seconds = time.perf_counter() - t0
            restore(model)
            reports = compile_reports()
            result["cases"][name] = {
                "tokens": tokens[0, PROMPT_TOKENS:].tolist(),
                "path_counts": cache.path_counts(),
                "reports": [[r.sites_rewritten, r.sites_total] for r in reports],
                "collectives": [_collectives(r.graph_module) for r in reports],
                "lowered": [r.lowered is not None for r in reports],
                "selections": [s.tolist() for s in selections],
                "query_state_heads": int(cache.query_state.shape[2]),
                "seconds": seconds,
            }
    path = Path(out)
    if world > 1:
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    path.write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()

if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    {"build": build, "run": run}[command](*rest)
