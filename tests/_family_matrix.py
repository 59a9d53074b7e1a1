"""The model-family matrix: every causal-LM family of transformers, built tiny and random
from its config (no downloads), decoded eagerly (dense, ``DynamicCache``) and through the
specontext backend (``SpeContextCache``), and compared.

``causal_lm_families()`` lists the families, ``tiny_config(model_type)`` shrinks a family's
default config generically (2 layers, hidden size 64, vocabulary 128, ...; the hand-tuned
configs of :mod:`specontext_compile.tiny_models` for the families it has), ``run_family``
runs one model (prefill + ``DECODE_STEPS`` steps) both ways, and ``run_case`` turns that into
one JSON-able row of the table (``scripts/family_table.py``).
"""

from __future__ import annotations

import inspect
import logging
import time
import traceback
from pathlib import Path

import torch

from specontext_compile.tiny_models import FAMILIES as HAND_TUNED
from specontext_compile.tiny_models import VOCAB, tiny_family
from specontext_compile.tiny_models import _config as _hand_tuned_config

log = logging.getLogger(__name__)

PROMPT_TOKENS, DECODE_STEPS, BUDGET = 30, 20, 128
EXACT_ATOL = 1e-4
_REPO = Path(__file__).resolve().parents[1]

# attribute names -> tiny value; set only where the family's config has an int there
_LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_SHRINK = {
    _LAYER_COUNT_NAMES: 2,
    ("hidden_size", "n_embd", "d_model", "emb_dim"): 64,
    ("num_attention_heads", "n_head", "n_heads"): 4,
    ("num_key_value_heads", "num_kv_heads", "n_kv_heads"): 2,
    ("head_dim", "dim_head", "attention_head_dim"): 16,
    ("rotary_dim",): 8,
    ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"): 256,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token"): 2,
    ("n_shared_experts", "num_shared_experts", "first_k_dense_replace"): 1,
    ("n_group", "num_expert_group", "topk_group"): 1,
    ("kv_lora_rank",): 32,
    ("q_lora_rank",): 48,
    ("qk_rope_head_dim",): 8,
    ("qk_nope_head_dim", "v_head_dim"): 16,
    ("linear_num_value_heads",): 4,
    ("linear_num_key_heads",): 2,
    ("linear_key_head_dim", "linear_value_head_dim"): 16,
    ("attn_layer_period", "expert_layer_period"): 2,  # hybrids (Jamba): layer 0 Mamba, layer 1 attention / MoE
    ("attn_layer_offset", "expert_layer_offset"): 1,
    ("sliding_window",): 24,  # smaller than prompt + decode, as in tiny_models
}
_LAYER_KIND_NAMES = ("layer_types", "layers_block_type")
# set even where the default config leaves them None (the model then fails to build)
_FILL_NONE = {"head_dim", "num_key_value_heads", "n_routed_experts", "n_shared_experts", "num_experts_per_tok"}

# per-family fixes where the generic shrink is not enough, by model_type (of a config or a sub-config)
OVERRIDES: dict[str, dict] = {
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # default layer_types: the first 2 are both attention
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # default layer_types None
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
                       "indexer_compress_ratio": 4},  # the indexer sizes default to None
    # counts attention and MLP blocks as separate layers (halved by the config); input + recurrent + output
    "dory": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp"],
             "n_input_layers": 2, "n_recurrent_layers": 0, "n_output_layers": 2},
    "mamba2": {"num_heads": 8},  # num_heads * head_dim == expand * hidden_size
    "zaya": {"num_experts_per_tok": 1},  # the only value it supports
    "dots3_note_text": {"num_key_value_heads": 4},  # must equal num_attention_heads
    "bamba": {"attn_layer_indices": [1]},  # default: no attention layer
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},  # default: only Mamba layers
    # its shared transformer block is tied across hybrid layers: needs two of them
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "gemma3n_text": {"num_kv_shared_layers": 0},  # default shares the KV of 15 layers
    "reformer": {"axial_pos_embds_dim": [32, 32]},  # must sum to hidden_size
    "xmod": {"default_language": "en_XX"},  # else the forward refuses: no language
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},  # default pattern of 3 starts with 2 recurrent
}


def causal_lm_families() -> list[str]:
    """Every ``model_type`` that ``AutoModelForCausalLM`` maps, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _layer_picks(layer_types: list) -> list[int]:
    """Two layer indices keeping a mix: the first layer of each of the first two kinds."""
    firsts = {}
    for i, kind in enumerate(layer_types):
        firsts.setdefault(str(kind), i)
    picks = sorted(firsts.values())[:2]
    return picks if len(picks) == 2 else [0, 1]


def _shrink(config) -> dict:
    """Overrides (kwargs) that make ``config`` tiny; sub-configs as nested dicts."""
    from transformers import PretrainedConfig

    values = config.to_dict()
    out = {}
    ints = {k: v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}
    for names, tiny in _SHRINK.items():
        out.update({n: tiny for n in names if n in ints or (n in _FILL_NONE and n in values and values[n] is None)})
    for name, value in ints.items():
        if "vocab_size" in name and value > VOCAB:
            out[name] = VOCAB
        elif name.endswith(("intermediate_size", "ffn_hidden_size", "ffn_dim", "dim_ff")) and value > 128:
            out[name] = 32 if name.startswith(("moe", "expert", "shared")) else 128
        elif name.endswith("token_id") and value >= VOCAB:  # special tokens must fit the vocabulary
            out[name] = VOCAB - 1
    for flag in ("is_decoder", "causal"):  # encoder-style families (BERT, XLM) as causal decoders
        if flag in values and not values.get("is_encoder_decoder"):
            out[flag] = True
    if "kv_lora_rank" in ints:  # multi-head latent attention: a KV head per query head, head_dim the rotary part
        for name, like in (("num_key_value_heads", "num_attention_heads"), ("head_dim", "qk_rope_head_dim")):
            if name in out and like in out:
                out[name] = out[like]
    layers = next((ints[n] for n in _LAYER_COUNT_NAMES if n in ints), None)
    if layers and layers > 2:
        kinds = next((values[n] for n in _LAYER_KIND_NAMES if isinstance(values.get(n), list)), [])
        picks = _layer_picks(kinds)
        for name, value in values.items():  # every per-layer list keeps the picked layers
            if isinstance(value, list) and len(value) == layers:
                out[name] = [value[i] for i in picks]
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if isinstance(sub, PretrainedConfig) and (tiny := _shrink(sub)):
            out[name] = {"model_type": sub.model_type, **tiny}
    return {**out, **OVERRIDES.get(config.model_type, {})}


def tiny_config(model_type: str):
    """A tiny config of ``model_type``: the hand-tuned one of ``tiny_models`` if it has the
    family, else ``AutoConfig.for_model`` with every usual size attribute shrunk (2 layers,
    hidden 64, 4 heads, 2 KV heads, vocabulary 128, small MoE; per-layer lists such as
    ``layer_types`` cut to 2 layers keeping a mix of kinds; sub-configs likewise), plus
    :data:`OVERRIDES`. Raises what transformers raises when it cannot build it."""
    from transformers import AutoConfig

    if model_type in HAND_TUNED:
        return _hand_tuned_config(model_type)
    default = AutoConfig.for_model(model_type)
    return AutoConfig.for_model(model_type, **_shrink(default))


def tiny_model(model_type: str, attn: str, seed: int = 0) -> torch.nn.Module:
    """A random tiny ``AutoModelForCausalLM`` of ``model_type`` with ``attn_implementation=attn``."""
    from transformers import AutoModelForCausalLM

    if model_type in HAND_TUNED:
        return tiny_family(model_type, attn, seed)
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def _prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))


def dense_decode(model) -> list[torch.Tensor]:
    """Eager dense decoding (``DynamicCache``): prefill then ``DECODE_STEPS`` greedy steps;
    last-position logits ``[1, vocab]`` of every call."""
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        logits = model(input_ids=_prompt(), cache=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        for _ in range(DECODE_STEPS):
            logits = model(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    return out


def compiled_decode(model, eager: list[torch.Tensor], **options) -> dict:
    """Compiled specontext decoding (``SpeContextCache``, backend ``options``; default
    ``budget=BUDGET``, the whole context), fed the eager run's greedy tokens so that one
    near-tie cannot make the runs diverge. Keys as :func:`run_family` (less ``eager``)."""
    import specontext_compile as sc

    forward = torch.compile(model.forward, backend="specontext", options={"budget": BUDGET, **options})
    cache = sc.SpeContextCache(model.config, max_cache_len=PROMPT_TOKENS + DECODE_STEPS + 1)
    with torch.no_grad():
        compiled = [forward(input_ids=_prompt(), cache=cache, use_cache=True).logits[:, -1]]
    seen = {id(r) for r in sc.compile_reports()}  # the report list is bounded: compare by identity
    calls_before = cache.path_counts()["sparse_sites"]
    with torch.no_grad():
        for step in range(DECODE_STEPS):
            nxt = eager[step].argmax(-1, keepdim=True)
            compiled.append(forward(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1])
    reports = [r for r in sc.compile_reports() if id(r) not in seen]
    sites = [s for r in reports for s in r.result.sites]
    return {
        "compiled": compiled,
        "max_err": max((a - b).abs().max().item() for a, b in zip(compiled, eager)),
        "decode_sites": len(sites),
        "decode_rewritten": sum(r.result.rewritten for r in reports),
        "decode_graphs": len(reports),
        "reasons": sorted({s.reason for s in sites if s.reason}),
        "unexplained": [s for s in sites if not s.reason and not str(s.node.target).startswith("specontext.")],
        "sparse_calls": cache.path_counts()["sparse_sites"] - calls_before,  # counted by the compiled step
        "path_counts": cache.path_counts(),
        "reports": reports,
    }


def run_family(family: str, attn: str, **options) -> dict:
    """Eager dense vs compiled specontext decoding of the tiny ``family`` model.

    Returns a dict: ``eager`` and ``compiled`` (lists of ``[1, vocab]`` last-position
    logits: prefill + ``DECODE_STEPS`` steps), ``max_err`` (max |diff| over all of them),
    ``decode_sites``/``decode_rewritten`` (sites in the graphs compiled during the decode
    steps and how many were rewritten; ``decode_graphs``: how many graphs, more than one where
    the step recompiles or breaks), ``reasons`` (sorted fallback reasons there),
    ``unexplained`` (sites left dense without a reason), ``sparse_calls`` (sparse attention
    calls in the decode steps), ``path_counts`` (the cache's counters), ``reports``, ``model``.

    Raises:
        ValueError: from transformers when ``family`` has no ``attn`` implementation.
    """
    model = tiny_model(family, attn)
    eager = dense_decode(model)
    return {"eager": eager, **compiled_decode(model, eager, **options), "model": model}


def _first_line(err: BaseException) -> str:
    """``Type: first line`` of the message (two lines where the first only introduces the second)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [""]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{type(err).__name__}: {text[:300]}"


def _ours(filename: str) -> bool:
    """Whether ``filename`` is this repository's code (not its virtual environment nor this harness)."""
    path = Path(filename).resolve()
    return (path.is_relative_to(_REPO) and not path.relative_to(_REPO).parts[0].startswith(".")
            and path != Path(__file__).resolve())


def _crash(err: BaseException) -> dict:
    """Exception, message, this repository's frames and the last frames of the traceback;
    ``deliberate``: a ValueError/NotImplementedError raised by this repository's own code (a
    refusal with a message, not a failure inside torch or transformers)."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = [f for f in frames if _ours(f.filename)]
    return {
        "exception": type(err).__name__,
        "deliberate": bool(ours) and frames[-1] is ours[-1] and isinstance(err, (ValueError, NotImplementedError)),
        "message": str(err).strip()[:2000],
        "our_frames": [f"{Path(f.filename).resolve().relative_to(_REPO)}:{f.lineno} {f.name}" for f in ours][-6:],
        "frames": [f"{f.filename}:{f.lineno} {f.name}" for f in frames][-8:],
    }


def _refused(err: BaseException) -> bool:
    text = str(err)
    return "attention implementation" in text or "does not support" in text


def _build(model_type: str, attn: str) -> tuple[torch.nn.Module | None, str, dict]:
    """The tiny model (``attn="auto"``: sdpa if transformers accepts it, else eager), the
    attention used, and a result dict with ``status``/``reasons`` when it could not be built."""
    try:
        config = tiny_config(model_type)
    except Exception as err:  # noqa: BLE001 - any failure of transformers' config code
        return None, attn, {"status": "no_config", "reasons": [_first_line(err)]}
    if getattr(config, "is_encoder_decoder", False):
        return None, attn, {"status": "no_model", "reasons": ["encoder-decoder model"]}
    for choice in (("sdpa", "eager") if attn == "auto" else (attn,)):
        try:
            return tiny_model(model_type, choice), choice, {}
        except Exception as err:  # noqa: BLE001
            if _refused(err) and choice == "sdpa" and attn == "auto":
                continue
            status = "refused" if _refused(err) else "no_model"
            return None, choice, {"status": status, "reasons": [_first_line(err)]}
    raise AssertionError("unreachable")


def run_case(model_type: str, attn: str = "auto", **options) -> dict:
    """One row of the family table, JSON-able: ``family``, ``attn``, ``status``
    (``rewritten`` every decode site, ``partial``, ``dense`` none (``reasons`` say why),
    ``no_config``/``no_model``/``refused`` transformers could not build or run it tiny, or
    refused ``attn``, ``cache_refuses`` ``SpeContextCache`` refuses the model with an error
    naming the fix (no attention layer, a cache layer kind only the model's own cache holds),
    ``wrong`` logits off by more than ``EXACT_ATOL`` (a bug), ``crash`` the backend or
    ``SpeContextCache`` raised otherwise: see ``crash``),
    ``decode_sites``, ``decode_rewritten``, ``reasons``, ``max_abs_logit_err``, ``exact``
    (within ``EXACT_ATOL``), ``gather_path`` (every rewritten site ran the gather path, per
    the compiled step's counters), ``path_counts`` and ``seconds``. Backend ``options``
    default to ``budget=BUDGET, dense_shortcut=False``."""
    start = time.perf_counter()
    torch._dynamo.reset()
    row = {"family": model_type, "attn": attn, "status": None, "decode_graphs": None, "decode_sites": None,
           "decode_rewritten": None, "reasons": [], "max_abs_logit_err": None, "exact": None, "gather_path": None}
    model, row["attn"], failed = _build(model_type, attn)
    if model is not None and "cache" not in inspect.signature(model.forward).parameters:
        failed = {"status": "no_model", "reasons": ["its forward takes no `cache` (decodes without a KV cache)"]}
        model = None
    if model is None:
        return {**row, **failed, "seconds": round(time.perf_counter() - start, 1)}
    try:
        eager = dense_decode(model)
    except Exception as err:  # noqa: BLE001 - transformers cannot decode it this way
        return {**row, "status": "no_model", "reasons": [f"eager decode: {_first_line(err)}"],
                "seconds": round(time.perf_counter() - start, 1)}
    try:
        r = compiled_decode(model, eager, **{"dense_shortcut": False, **options})
    except Exception as err:  # ours (or dynamo under our backend)
        log.info("%s/%s crashed", model_type, row["attn"], exc_info=True)
        crash = _crash(err)
        if crash["deliberate"] and str(err).startswith("SpeContextCache:"):  # a refusal naming the fix
            return {**row, "status": "cache_refuses", "reasons": [_first_line(err)],
                    "seconds": round(time.perf_counter() - start, 1)}
        reason = ("refused by specontext: " if crash["deliberate"] else "") + _first_line(err)
        return {**row, "status": "crash", "reasons": [reason], "crash": crash,
                "seconds": round(time.perf_counter() - start, 1)}
    total, done = r["decode_sites"], r["decode_rewritten"]
    reasons = list(r["reasons"]) + (["a site stayed dense without a reason"] if r["unexplained"] else [])
    if total == 0:
        reasons.append("no attention site in the decode graphs")
    counts = r["path_counts"]
    return {
        **row,
        # a rewrite that is not exact at full budget is a bug, never "rewritten"
        "status": ("wrong" if r["max_err"] > EXACT_ATOL else
                   "rewritten" if total and done == total else "partial" if done else "dense"),
        "decode_sites": total,
        "decode_rewritten": done,
        "reasons": reasons,
        "max_abs_logit_err": r["max_err"],
        "exact": r["max_err"] <= EXACT_ATOL,
        "gather_path": None if not done else (r["sparse_calls"] > 0 and counts["dense_store_sites"] == 0
                                              and counts["gather_sites"] == r["sparse_calls"]),
        "decode_graphs": r["decode_graphs"],
        "path_counts": counts,
        "seconds": round(time.perf_counter() - start, 1),
    }
