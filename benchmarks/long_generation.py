"""Long generations: the default's fidelity and step time when most of the context was generated.

The paper's setting is long outputs (reasoning traces of thousands of tokens), where the KV
cache is mostly the model's own output and the selection must keep finding what the next
token needs. Protocol (one process, one run):

1. **prompt**: a chat turn of ``--prompt`` tokens — the first tokens of ``pydoc_data.topics``
   (real text) wrapped in an instruction to explain it step by step (SmolLM2's chat template);
2. **dense generation** of ``--generate`` tokens with Hugging Face eager decoding
   (``DynamicCache``, SDPA; end-of-sequence suppressed so the output reaches its length),
   greedy or, with ``--temperature``, sampled with a seed (SmolLM2-135M's greedy output
   falls into a loop within a few hundred tokens, an easy case for any selection: the sampled
   text is the model's own and does not loop); each step records the dense argmax, its lead
   over the runner-up (nats) and the step time;
3. **teacher-forced replays** of prompt + generated tokens through each contender: the
   default backend (``torch.compile(..., backend="specontext")``, budget ``--budget``, every
   other option at its default) and our own compiled dense step (``own-dense`` of
   :mod:`benchmarks.decode`, the strongest dense baseline). Prefill is dense and exact; every
   later step is a decode step over a context that grows from ``--prompt`` to ``--prompt +
   --generate`` tokens.

Reported per contender: greedy **agreement** with the dense run over all decode steps and per
window of ``--window`` steps (the context at the window's start), how many lost steps were
dense near ties, the mean NLL increase (nats/token) of the dense token, the **median step ms
per window** (decode steps timed one by one, ``perf_counter`` around each call), and the
path counters of the cache (how many sites ran sparse). The generated text's repetition
(distinct 4-gram share) is reported too: a looping output is an easy case for any selection.

    python -m benchmarks.long_generation --prompt 2048 --generate 4096 --temperature 1.0 --top-k 50 --json docs/results/long_generation.json
    python -m benchmarks.long_generation --model tiny --prompt 96 --generate 64 --window 16 --json /tmp/lg.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs" / "results"
INSTRUCTION = ("Explain the documentation above step by step, in detail, with an example "
               "for every part, then summarise it.")
NEAR_TIE_NATS = (0.1, 0.5, 1.0)


# --------------------------------------------------------------------------- inputs


def chat_prompt(tokenizer, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` int64: SmolLM2's chat template around the first tokens of
    ``pydoc_data.topics`` and :data:`INSTRUCTION`, the text cut so the whole turn (generation
    prompt included) is exactly ``tokens`` long.

    Raises:
        ValueError: ``tokens`` leaves no room for text after the template and instruction.
    """
    import pydoc_data.topics

    marker = "\u2063"  # a character the text does not contain: where the document goes
    turn = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{marker}\n\n{INSTRUCTION}"}],
        tokenize=False, add_generation_prompt=True)
    head, tail = turn.split(marker)
    head_ids = tokenizer(head, add_special_tokens=False, return_tensors="pt").input_ids
    tail_ids = tokenizer(tail, add_special_tokens=False, return_tensors="pt").input_ids
    room = tokens - head_ids.shape[1] - tail_ids.shape[1]
    if room < 1:
        raise ValueError(f"--prompt {tokens} leaves no room for text after the chat template "
                         f"and instruction ({tokens - room} tokens): use a longer prompt")
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    doc = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :room]
    return torch.cat([head_ids, doc, tail_ids], dim=1)


def distinct_ngram_share(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams / n-grams of a token sequence (1.0: no n-gram repeats)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / max(len(grams), 1)


# --------------------------------------------------------------------------- decoding


def decode(forward, cache, prompt: torch.Tensor, steps: int, feed: torch.Tensor | None = None,
           suppress: list[int] = (), temperature: float = 0.0, top_k: int = 0, seed: int = 0,
           desc: str = "", progress: bool = True) -> dict:
    """Prefill ``prompt`` (``[1, P]``) then ``steps - 1`` decode steps.

    With ``feed`` (int64 ``[steps]``) the steps are teacher-forced: step ``i`` feeds
    ``feed[i - 1]``; without it the run generates: greedy (``temperature`` 0) or sampled
    from ``softmax(logits / temperature)`` over the ``top_k`` best ids (0 = all; a
    ``torch.Generator`` seeded with ``seed``), ``suppress``'d ids (e.g. end-of-sequence)
    masked out first. Returns float64/int64 tensors of length
    ``steps``: ``argmax`` (the unmasked argmax after step ``i``; step 0 is the prefill's),
    ``chosen`` (the token decoded or fed next), ``margin`` (nats between the top two),
    ``nll`` (nats of ``chosen``), ``ms`` (the step's wall time; ``nan`` for the prefill) and
    ``prefill_s``."""
    from tqdm.auto import tqdm

    out = {k: torch.zeros(steps, dtype=torch.float64) for k in ("margin", "nll", "ms")}
    argmax = torch.zeros(steps, dtype=torch.long)
    chosen = torch.zeros(steps, dtype=torch.long)
    out["ms"][0] = math.nan
    bar = tqdm(total=steps, desc=desc, leave=False, disable=not progress)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = forward(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        prefill_s = time.perf_counter() - t0
        for i in range(steps):
            if i:
                tok = chosen[i - 1].view(1, 1)
                t0 = time.perf_counter()
                logits = forward(input_ids=tok, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
                out["ms"][i] = 1000 * (time.perf_counter() - t0)
            logp = torch.log_softmax(logits.double(), -1)
            top = logp.topk(2)
            argmax[i] = top.indices[0]
            out["margin"][i] = top.values[0] - top.values[1]
            if feed is not None:
                chosen[i] = feed[i]
            else:
                masked = logp.clone()
                masked[list(suppress)] = -math.inf
                chosen[i] = masked.argmax() if temperature <= 0 else _sample(masked, temperature, top_k, generator)
            out["nll"][i] = -logp[chosen[i]]
            bar.update(1)
    bar.close()
    return {"argmax": argmax, "chosen": chosen, **out, "prefill_s": prefill_s}


def _sample(logp: torch.Tensor, temperature: float, top_k: int, generator) -> torch.Tensor:
    """One id drawn from ``softmax(logp / temperature)`` restricted to the ``top_k`` best."""
    if top_k:
        best = logp.topk(top_k)
        pick = torch.multinomial(torch.softmax(best.values / temperature, -1), 1, generator=generator)
        return best.indices[pick[0]]
    return torch.multinomial(torch.softmax(logp / temperature, -1), 1, generator=generator)[0]


def windows(values: torch.Tensor, window: int, start: int = 1) -> list[torch.Tensor]:
    """``values[start:]`` cut into consecutive windows of ``window`` steps (the last may be
    shorter)."""
    return [values[i:i + window] for i in range(start, values.numel(), window)]


def compare(run: dict, dense: dict, prompt_tokens: int, window: int) -> dict:
    """Agreement, NLL increase, near ties among lost steps and step ms (median, max, steps
    over 5x the median) of ``run`` against the dense run's argmax, overall and per window
    (decode steps only: step 0 is the prefill)."""
    same = (run["argmax"] == dense["argmax"]).double()
    lost = (same[1:] == 0).nonzero().flatten() + 1
    margins = dense["margin"][lost]
    per_window = []
    for w, (s, m) in enumerate(zip(windows(same, window), windows(run["ms"], window))):
        first = 1 + w * window
        per_window.append({"first_step": first, "context_at_start": prompt_tokens + first,
                           "steps": s.numel(), "agreement": float(s.mean()),
                           "ms_median": float(m.median()), "ms_max": float(m.max())})
    ms = run["ms"][1:]
    slow = (ms > 5 * ms.median()).nonzero().flatten()
    return {
        "agreement": float(same[1:].mean()), "decode_steps": int(same[1:].numel()),
        "lost_steps": int(lost.numel()),
        "lost_near_ties": {f"margin<{t:g}": int((margins < t).sum()) for t in NEAR_TIE_NATS},
        "nll_delta": float((run["nll"][1:] - dense["nll"][1:]).mean()),
        "ms_median": float(ms.median()), "ms_first_window": per_window[0]["ms_median"],
        "ms_last_window": per_window[-1]["ms_median"], "prefill_s": run["prefill_s"],
        # steps over 5x the median (a recompile, a page fault storm): step index and ms
        "slow_steps": [[int(i) + 1, round(float(ms[i]), 1)] for i in slow],
        "windows": per_window,
    }


# --------------------------------------------------------------------------- contenders


def contender_forward(model, name: str, budget: int):
    """``(forward, cache factory)`` of a contender: ``"dense"`` (Hugging Face eager),
    ``"default"`` (the backend at ``budget``) or ``"own-dense"`` (our dense step)."""
    from transformers import DynamicCache

    import specontext_compile as sc
    from benchmarks.decode import OWN_DENSE

    if name == "dense":
        return model.forward, lambda capacity: DynamicCache(config=model.config)
    torch._dynamo.reset()
    if name == "default":
        forward = torch.compile(model.forward, backend="specontext", options={"budget": budget})
    elif name == "own-dense":
        forward = torch.compile(model.forward, backend="specontext", **OWN_DENSE)
    else:
        raise ValueError(f"unknown contender {name!r}: dense, default or own-dense")
    return forward, lambda capacity: sc.SpeContextCache(model.config, max_cache_len=capacity)


def load(args):
    """``(model, prompt ids [1, P], end-of-sequence ids to suppress, label)``."""
    if args.model == "tiny":
        from benchmarks.decode import random_model, tiny_config

        model = random_model(tiny_config())
        prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt),
                               generator=torch.Generator().manual_seed(0))
        return model, prompt, [], "tiny (random weights)", None
    from specontext_compile.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    eos = tokenizer.eos_token_id
    suppress = sorted({eos} if isinstance(eos, int) else set(eos or ()))
    return model, chat_prompt(tokenizer, args.prompt), suppress, "smollm2-135m", tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_generation",
                                     description=doc[0], epilog=doc[-1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "tiny"))
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--generate", type=int, default=4096,
                        help="generated tokens (default 4096)")
    parser.add_argument("--budget", type=int, default=1024, help="the default's budget (tokens)")
    parser.add_argument("--window", type=int, default=512, help="steps per reported window")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: the dense run generates greedily; > 0: it samples (seeded), so "
                             "the output does not loop; every replay is still compared with "
                             "the dense argmax at each step")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k best ids (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--contenders", nargs="+", default=["default", "own-dense"],
                        choices=("default", "own-dense"), help="teacher-forced replays")
    parser.add_argument("--json", type=Path, default=DOCS / "long_generation.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.prompt < 2 or args.generate < 2 or args.window < 1 or args.budget < 1:
        parser.error("--prompt and --generate must be >= 2, --window and --budget >= 1")
    if args.temperature < 0 or args.top_k < 0:
        parser.error("--temperature and --top-k must be >= 0")
    return args


def format_table(result: dict) -> str:
    """Per contender and window: agreement and median step ms (Markdown)."""
    lines = ["| contender | steps | context at start | agreement | median ms |", "|---|---:|---:|---:|---:|"]
    for name, row in result["contenders"].items():
        for w in row["windows"]:
            lines.append(f"| {name} | {w['first_step']}-{w['first_step'] + w['steps'] - 1} | "
                         f"{w['context_at_start']} | {w['agreement']:.3f} | {w['ms_median']:.1f} |")
        lines.append(f"| **{name}, all** | {row['decode_steps']} | - | **{row['agreement']:.3f}** | "
                     f"{row['ms_median']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the protocol of the module docstring; returns the exit status."""
    args = parse_args(argv)
    import specontext_compile as sc

    started = time.time()
    model, prompt, suppress, label, tokenizer = load(args)
    prompt_tokens, steps = prompt.shape[1], args.generate
    capacity = prompt_tokens + steps + 1
    progress = not args.no_progress
    forward, make = contender_forward(model, "dense", args.budget)
    dense = decode(forward, make(capacity), prompt, steps, suppress=suppress,
                   temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                   desc="dense generation", progress=progress)
    generated = dense["chosen"].tolist()
    result = {
        "command": "python -m benchmarks.long_generation " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": label, "prompt_tokens": prompt_tokens, "generated_tokens": steps,
        "budget": args.budget, "window": args.window, "torch": torch.__version__,
        "temperature": args.temperature, "top_k": args.top_k, "seed": args.seed,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "dense": {"ms_median": float(dense["ms"][1:].median()),
                  "windows": [{"first_step": 1 + i * args.window, "ms_median": float(m.median())}
                              for i, m in enumerate(windows(dense["ms"], args.window))],
                  "prefill_s": dense["prefill_s"],
                  "steps_not_fed_the_argmax": int((dense["argmax"] != dense["chosen"]).sum())},
        "generated_distinct_4gram_share": distinct_ngram_share(generated),
        "contenders": {},
    }
    if tokenizer is not None:
        text = tokenizer.decode(generated)
        result["generated_text_head"], result["generated_text_tail"] = text[:400], text[-400:]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for name in args.contenders:
        forward, make = contender_forward(model, name, args.budget)
        cache = make(capacity)
        run = decode(forward, cache, prompt, steps, feed=dense["chosen"], desc=name, progress=progress)
        row = compare(run, dense, prompt_tokens, args.window)
        row["paths"] = {k: v for k, v in sc.path_counts(cache).items() if isinstance(v, (int, float))}
        result["contenders"][name] = row
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if "own-dense" in result["contenders"] and "default" in result["contenders"]:
        own, ours = result["contenders"]["own-dense"], result["contenders"]["default"]
        result["default_vs_own_dense"] = {
            "all": own["ms_median"] / ours["ms_median"],
            "windows": [o["ms_median"] / d["ms_median"] for o, d in zip(own["windows"], ours["windows"])]}
    result["seconds_total"] = time.time() - started
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    if "default_vs_own_dense" in result:
        ratios = ", ".join(f"{r:.2f}x" for r in result["default_vs_own_dense"]["windows"])
        print(f"default vs own dense per window: {ratios}")
    print(f"dense eager median {result['dense']['ms_median']:.1f} ms; distinct 4-gram share of the "
          f"output {result['generated_distinct_4gram_share']:.3f}; total {result['seconds_total']:.0f} s; "
          f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
