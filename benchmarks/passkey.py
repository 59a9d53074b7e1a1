"""Passkey retrieval (needle in a haystack): dense vs specontext per budget (issue 12 item 5).

A 5-digit pass key is hidden at several depths in ``length`` tokens of plain English the
project ships (Python's ``pydoc_data.topics``, joined as :mod:`benchmarks.fidelity` does), as
one user turn of SmolLM2-135M-Instruct's chat template; the model answers greedily
(``max_new_tokens`` tokens). A case is *solved* when the key's 5 digits appear in the decoded
answer (:func:`is_solved`). Each case runs once dense (plain eager ``model.generate``) and once
per ``(budget, candidates)`` through ``specontext_compile.compile``.

Prompt (phrasing ``intro_prefix``, the default; see :data:`PHRASINGS` and
docs/results/passkey_sweep.json)::

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the pass key.

    <haystack, first part>

    The pass key is 48213. Remember it. 48213 is the pass key.

    <haystack, rest>

    What is the pass key? Answer with the number only.<|im_end|>
    <|im_start|>assistant
    The pass key is

Why this phrasing (dense SmolLM2-135M, greedy, 8 new tokens): with ``plain`` (no reply
prefix) at 2K tokens it answers "The pass key is 599" / "... 306" / "... 901" at depths
0.1/0.5/0.9: it restates the needle sentence, and as every digit is one token, 8 new tokens
end after 3 of the 5 digits (those digits are right). Starting the reply with "The pass key
is" (``prefix``) gives " 59944." and solves all three at 2K, but at 4K it answers " 9." and
" 5." (first digit only) at depths 0.1 and 0.5. Adding the intro sentence of the usual
passkey task (``intro_prefix``) solves both 4K cases (" 95650.", " 50449."), as does
repeating the needle (``repeat_prefix``); ``intro_prefix`` keeps the needle sentence single.
Runs: out/passkey/dense_2k_{plain,prefix}.json, out/passkey/dense_4k_*.json.

The needle goes in at a paragraph boundary (``\\n\\n``; a line boundary where no paragraph
boundary is near) nearest to ``depth`` x haystack tokens; the haystack is cut at a line
boundary so that the whole prompt is at most ``length`` tokens (a few tokens under).

Compiled runs use one :class:`SpeContextCache` capacity for every prompt (the longest prompt
plus ``max_new_tokens``), so one configuration compiles its decode step once for every
length; ``torch._dynamo.reset()`` runs between configurations. Results are written after
every run; an existing ``--out`` is resumed (runs already in it are skipped).

    .venv/bin/python -m benchmarks.passkey --lengths 2048 4096 8000 --depths 0.1 0.5 0.9 \\
        --budgets 256 512 1024 --candidates 1 2 --out docs/results/passkey_sweep.json
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import math
import logging
import os
import pydoc_data.topics
import random
import re
import shlex
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["PHRASINGS", "PasskeyPrompt", "build_passkey_prompt", "haystack_text", "is_solved",
           "load_tokenizer", "make_key", "run_dense", "run_ours", "summarize", "summary_table"]

MODEL = "smollm2-135m"
DEFAULT_PHRASING = "intro_prefix"

# intro: text before the haystack; needle: the hidden sentence ({key}); question: after the
# haystack; prefix: start of the assistant's reply (appended after the generation prompt)
PHRASINGS: dict[str, dict[str, str]] = {
    "plain": {
        "intro": "",
        "needle": "The pass key is {key}. Remember it. {key} is the pass key.",
        "question": "What is the pass key? Answer with the number only.",
        "prefix": "",
    },
    "prefix": {
        "intro": "",
        "needle": "The pass key is {key}. Remember it. {key} is the pass key.",
        "question": "What is the pass key? Answer with the number only.",
        "prefix": "The pass key is",
    },
    "intro_prefix": {
        "intro": "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the pass key.\n\n",
        "needle": "The pass key is {key}. Remember it. {key} is the pass key.",
        "question": "What is the pass key? Answer with the number only.",
        "prefix": "The pass key is",
    },
    "repeat_prefix": {
        "intro": "",
        "needle": "The pass key is {key}. Remember it. {key} is the pass key. "
                  "The pass key is {key}. Remember it. {key} is the pass key.",
        "question": "What is the pass key? Answer with the number only.",
        "prefix": "The pass key is",
    },
}


@functools.lru_cache(maxsize=1)
def haystack_text() -> str:
    """The plain-English corpus: every ``pydoc_data.topics`` entry, sorted by name, joined by
    blank lines (as :mod:`benchmarks.fidelity` builds it)."""
    return "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def load_tokenizer(name: str = MODEL):
    """The tokenizer of ``name`` alone (no weights loaded)."""
    from transformers import AutoTokenizer

    from specontext_compile.models import resolve_model

    directory, gguf = resolve_model(name)
    return AutoTokenizer.from_pretrained(directory, **({"gguf_file": gguf} if gguf else {}))


def make_key(length: int, depth: float, seed: int = 0, text: str | None = None) -> str:
    """A 5-digit key, fixed by ``(seed, length, depth)``, that does not occur in ``text``
    (default: the haystack corpus)."""
    text = haystack_text() if text is None else text
    rng = random.Random(f"passkey-{seed}-{length}-{depth}")
    while True:
        key = str(rng.randint(10000, 99999))
        if key not in text:
            return key


def is_solved(answer: str, key: str) -> bool:
    """The key's 5 digits appear, in order and adjacent, in ``answer`` (digit groups split by
    one comma, space or thin space, e.g. "48,213", count too)."""
    return key in re.sub(r"(?<=\d)[,\s\u2009](?=\d)", "", answer)


@dataclasses.dataclass
class PasskeyPrompt:
    """One prompt: ``ids`` ``[1, tokens]`` and where the needle went.

    ``depth`` is the realised depth: haystack tokens before the needle / haystack tokens
    (each part tokenised on its own).
    """

    ids: torch.Tensor
    key: str
    requested_depth: float
    depth: float
    haystack_tokens: int
    before_tokens: int
    user_text: str
    prefix: str

    @property
    def tokens(self) -> int:
        return self.ids.shape[-1]


@functools.lru_cache(maxsize=4)
def _corpus_tokens(tokenizer, chars: int) -> tuple[str, tuple[int, ...]]:
    """(text, token start offsets) of the first ``chars`` characters of the corpus."""
    text = haystack_text()[:chars]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return text, tuple(start for start, _ in enc["offset_mapping"])


def _chat_ids(tokenizer, user_text: str, prefix: str) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(user_text, return_tensors="pt").input_ids
    if prefix:
        extra = tokenizer(prefix, add_special_tokens=False, return_tensors="pt").input_ids
        ids = torch.cat([ids, extra], dim=-1)
    return ids


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _boundaries(text: str, sep: str) -> list[int]:
    """Character positions right after each ``sep`` in ``text`` (starts of paragraphs/lines)."""
    return [m.end() for m in re.finditer(re.escape(sep), text)]


def build_passkey_prompt(tokenizer, length: int, depth: float, key: str, *,
                         phrasing: str | dict[str, str] = DEFAULT_PHRASING,
                         paragraph_slack: float = 0.02) -> PasskeyPrompt:
    """The passkey prompt of at most ``length`` tokens with ``key`` at ``depth``.

    Args:
        tokenizer: the model's tokenizer (its chat template is used when it has one).
        length: target prompt tokens (template, haystack, needle, question and reply prefix).
        depth: where the needle goes, as a fraction of the haystack's tokens (0..1).
        key: the pass key (digits).
        phrasing: a name in :data:`PHRASINGS` or such a dict.
        paragraph_slack: a paragraph boundary within this fraction of the haystack from the
            target is taken; otherwise the nearest line boundary.

    Raises:
        ValueError: ``length`` too short for the fixed parts, or ``depth`` outside [0, 1].
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    p = PHRASINGS[phrasing] if isinstance(phrasing, str) else phrasing
    needle = p["needle"].format(key=key)

    def user(before: str, after: str) -> str:
        parts = [before.rstrip("\n"), needle, after.strip("\n"), p["question"]]
        return p["intro"] + "\n\n".join(part for part in parts if part)

    overhead = _chat_ids(tokenizer, user("", ""), p["prefix"]).shape[-1]
    budget = length - overhead
    if budget < 16:
        raise ValueError(f"length {length} leaves {budget} haystack tokens (fixed parts take {overhead})")
    text, starts = _corpus_tokens(tokenizer, max(4096, 8 * length))
    if budget >= len(starts):
        raise ValueError(f"length {length} is longer than the corpus prefix")
    # cut the haystack at the last line start at or before token `budget` (joins add a few)
    cut = text.rfind("\n", 0, starts[budget - 4])
    hay = text[:cut].rstrip("\n")
    for _ in range(8):  # joining parts may tokenise slightly longer: trim a line at a time
        ids = _chat_ids(tokenizer, user(hay, ""), p["prefix"])
        if ids.shape[-1] <= length:
            break
        hay = hay[:hay.rfind("\n")].rstrip("\n")
    hay_tokens = _count(tokenizer, hay)
    # insertion point: nearest paragraph boundary to the target token, else nearest line start
    hay_starts = starts[:bisect.bisect_left(starts, len(hay))]
    target_char = hay_starts[min(len(hay_starts) - 1, round(depth * hay_tokens))] if depth < 1 else len(hay)

    def nearest(cands: list[int]) -> int | None:
        cands = [0, *cands, len(hay)]
        return min(cands, key=lambda c: abs(c - target_char)) if cands else None

    pos = nearest(_boundaries(hay, "\n\n"))
    if abs(bisect.bisect_left(hay_starts, pos) - depth * hay_tokens) > paragraph_slack * hay_tokens:
        pos = nearest(_boundaries(hay, "\n"))
    before, after = hay[:pos], hay[pos:]
    user_text = user(before, after)
    ids = _chat_ids(tokenizer, user_text, p["prefix"])
    before_tokens = _count(tokenizer, before.rstrip("\n")) if before.strip() else 0
    return PasskeyPrompt(ids=ids, key=key, requested_depth=depth, depth=before_tokens / hay_tokens,
                         haystack_tokens=hay_tokens, before_tokens=before_tokens, user_text=user_text,
                         prefix=p["prefix"])


# ---------------------------------------------------------------------------------------------
# runs


def _decode_answer(tokenizer, out: torch.Tensor, prompt_tokens: int) -> str:
    return tokenizer.decode(out[0, prompt_tokens:], skip_special_tokens=True)


def run_dense(model, tokenizer, prompt: PasskeyPrompt, max_new_tokens: int) -> str:
    """Greedy answer of the plain eager model."""
    with torch.no_grad():
        out = model.generate(prompt.ids, attention_mask=torch.ones_like(prompt.ids),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return _decode_answer(tokenizer, out, prompt.tokens)


def run_ours(model, tokenizer, prompt: PasskeyPrompt, max_new_tokens: int, capacity: int) -> tuple[str, dict]:
    """Greedy answer through the compiled model (``specontext_compile.compile`` already
    applied), with a fresh cache of ``capacity`` tokens: (answer, cache.path_counts())."""
    import specontext_compile as sc

    retrieval_head = sc.SpeContextConfig.from_options(getattr(model, "_specontext_options", {})).retrieval_head
    cache = sc.SpeContextCache(model.config, max_cache_len=capacity, retrieval_head=retrieval_head)
    with torch.no_grad():
        out = model.generate(prompt.ids, attention_mask=torch.ones_like(prompt.ids),
                             max_new_tokens=max_new_tokens, do_sample=False, cache=cache)
    return _decode_answer(tokenizer, out, prompt.tokens), cache.path_counts()


def config_name(budget: int, candidates: float, page_rescue: int = 0) -> str:
    """``b<budget>_c<candidates>``, plus ``_r<tokens>`` with a page rescue (runs before the
    third pass of issue 12 had none: their names have no suffix)."""
    return f"b{budget}_c{candidates:g}" + (f"_r{page_rescue}" if page_rescue else "")


def config_order(name: str) -> tuple[int, float, int]:
    """Sort key of a :func:`config_name`: ``(budget, candidates, page_rescue)``."""
    parts = dict((p[0], p[1:]) for p in name.split("_"))
    return int(parts["b"]), float(parts["c"]), int(parts.get("r", 0))


def _rescue(budget: int, page_rescue: int | None) -> int:
    """The page rescue a run uses: the option, or the backend's default for ``budget``."""
    import specontext_compile as sc

    return sc.SpeContextConfig(budget=budget, page_rescue=page_rescue).page_rescue


def case_name(length: int, depth: float) -> str:
    return f"L{length}_d{depth:g}"


def summarize(cases: list[dict], configs: list[str]) -> dict:
    """Per configuration: cases dense solves, and how many of those (and overall) ours solves."""
    dense_ok = [c for c in cases if c.get("dense", {}).get("solved")]
    out = {"cases": len(cases), "dense_ran": sum("dense" in c for c in cases), "dense_solved": len(dense_ok),
           "configs": {}}
    for name in configs:
        ran = [c for c in cases if name in c.get("ours", {})]
        ran_ok = [c for c in dense_ok if name in c.get("ours", {})]
        out["configs"][name] = {
            "ran": len(ran),
            "solved": sum(c["ours"][name]["solved"] for c in ran),
            "dense_solved_ran": len(ran_ok),
            "solved_of_dense_solved": sum(c["ours"][name]["solved"] for c in ran_ok),
        }
    return out


def summary_table(cases: list[dict], configs: list[str]) -> str:
    """Markdown: one row per (length, depth) with the answers' verdicts, then the totals."""
    lines = ["| length | depth | key | dense | " + " | ".join(configs) + " |",
             "|---|---|---|---|" + "---|" * len(configs)]
    mark = {True: "yes", False: "no", None: "-"}
    for c in cases:
        cells = [mark[c["ours"][n]["solved"]] if n in c.get("ours", {}) else "-" for n in configs]
        dense = mark[c["dense"]["solved"]] if "dense" in c else "-"
        lines.append(f"| {c['length']} | {c['depth']:g} | {c['key']} | {dense} | " + " | ".join(cells) + " |")
    s = summarize(cases, configs)
    lines.append(f"| **solved / dense-solved** | | | {s['dense_solved']}/{s['dense_ran']} | " + " | ".join(
        f"{v['solved_of_dense_solved']}/{v['dense_solved_ran']}" for v in s["configs"].values()) + " |")
    lines.append("| **solved / ran** | | | | " + " | ".join(
        f"{v['solved']}/{v['ran']}" for v in s["configs"].values()) + " |")
    return "\n".join(lines)


def _save(path: Path, result: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--candidates", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--page-rescue", type=int, default=None,
                        help="option page_rescue for every configuration (default: the backend's, 2 x budget)")
    parser.add_argument("--phrasing", default=DEFAULT_PHRASING, choices=list(PHRASINGS))
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="key seed")
    parser.add_argument("--dense-only", action="store_true", help="only the dense runs (phrasing checks)")
    parser.add_argument("--only-dense-solved", action="store_true",
                        help="run ours only on cases dense solves (dense runs first); a later run "
                             "without it fills in the rest")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=Path("docs/results/passkey_sweep.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm

    import specontext_compile as sc
    from specontext_compile.models import load_model

    command = ".venv/bin/python -m benchmarks.passkey " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    settings = {"model": MODEL, "phrasing_name": args.phrasing, "phrasing": PHRASINGS[args.phrasing],
                "max_new_tokens": args.max_new_tokens, "seed": args.seed}
    result: dict = {}
    if args.out.exists():
        result = json.loads(args.out.read_text())
        if result.get("settings") != settings:
            raise SystemExit(f"{args.out} holds a run with other settings ({result.get('settings')}); "
                             "use another --out")
        logger.info("resuming %s", args.out)
    result["settings"] = settings
    result.setdefault("commands", [])
    if command not in result["commands"]:
        result["commands"].append(command)
    result["command"] = command
    result.setdefault("wall_seconds", 0.0)
    cases: dict[str, dict] = {case_name(c["length"], c["depth"]): c for c in result.get("cases", [])}
    configs = [] if args.dense_only else [(b, float(c)) for b in args.budgets for c in args.candidates]
    config_names = [config_name(b, c, _rescue(b, args.page_rescue)) for b, c in configs]
    result["configs"] = sorted(set(result.get("configs", [])) | set(config_names), key=config_order)

    model, tok = load_model(MODEL)
    max_positions = model.config.max_position_embeddings
    prompts: dict[str, PasskeyPrompt] = {}
    for length in args.lengths:
        if length + args.max_new_tokens > max_positions:
            raise SystemExit(f"length {length} + {args.max_new_tokens} new tokens exceeds {max_positions} positions")
        for depth in args.depths:
            name = case_name(length, depth)
            key = cases[name]["key"] if name in cases else make_key(length, depth, args.seed)
            prompt = build_passkey_prompt(tok, length, depth, key, phrasing=args.phrasing)
            prompts[name] = prompt
            case = cases.setdefault(name, {"length": length, "depth": depth, "key": key, "ours": {}})
            case.update(prompt_tokens=prompt.tokens, haystack_tokens=prompt.haystack_tokens,
                        realised_depth=round(prompt.depth, 4))
    capacity = max(p.tokens for p in prompts.values()) + args.max_new_tokens + 1
    todo = sum("dense" not in cases[n] for n in prompts) + sum(
        cn not in cases[n]["ours"] for cn in config_names for n in prompts)
    logger.info("%d cases, %d configs, %d runs to do (cache capacity %d)", len(prompts), len(configs), todo, capacity)
    t_start, wall0 = time.perf_counter(), result["wall_seconds"]

    def save() -> None:
        ordered = sorted(cases.values(), key=lambda c: (c["length"], c["depth"]))
        result["cases"] = ordered
        result["wall_seconds"] = round(wall0 + time.perf_counter() - t_start, 1)
        result["summary"] = summarize(ordered, result["configs"])
        result["summary_table"] = summary_table(ordered, result["configs"])
        _save(args.out, result)

    if args.only_dense_solved:  # the sparse runs of cases dense fails are not counted (done after dense)
        todo -= sum(cn not in c["ours"] for cn in config_names for n, c in cases.items()
                    if n in prompts and "dense" in c and not c["dense"]["solved"])
    bar = tqdm(total=todo, desc="passkey", dynamic_ncols=True)
    for name, prompt in prompts.items():
        case = cases[name]
        if "dense" in case:
            continue
        t0 = time.perf_counter()
        answer = run_dense(model, tok, prompt, args.max_new_tokens)
        case["dense"] = {"answer": answer, "solved": is_solved(answer, prompt.key),
                         "seconds": round(time.perf_counter() - t0, 1)}
        logger.info("%s dense: %r solved=%s (%.0fs)", name, answer, case["dense"]["solved"], case["dense"]["seconds"])
        save()
        bar.update(1)
    for (budget, candidates), cname in zip(configs, config_names):
        pending = [n for n in prompts if cname not in cases[n]["ours"]
                   and (not args.only_dense_solved or cases[n]["dense"]["solved"])]
        if not pending:
            continue
        torch._dynamo.reset()
        sc.compile(model, budget=budget, candidates=candidates, page_rescue=args.page_rescue)
        try:
            for name in pending:
                prompt = prompts[name]
                t0 = time.perf_counter()
                answer, counts = run_ours(model, tok, prompt, args.max_new_tokens, capacity)
                cases[name]["ours"][cname] = {
                    "budget": budget, "candidates": candidates if math.isfinite(candidates) else "inf",
                    "page_rescue": _rescue(budget, args.page_rescue), "answer": answer,
                    "solved": is_solved(answer, prompt.key), "path_counts": counts,
                    "seconds": round(time.perf_counter() - t0, 1)}
                logger.info("%s %s: %r solved=%s sparse_sites=%s (%.0fs)", name, cname, answer,
                            cases[name]["ours"][cname]["solved"], counts.get("sparse_sites"),
                            cases[name]["ours"][cname]["seconds"])
                save()
                bar.update(1)
        finally:
            sc.api.restore(model)
    bar.close()
    save()
    print(result["summary_table"])
    logger.info("wall %.0fs (this invocation %.0fs) -> %s", result["wall_seconds"],
                time.perf_counter() - t_start, args.out)


if __name__ == "__main__":
    main()
