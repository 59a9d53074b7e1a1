"""Teacher-forced agreement of the vLLM plugin beside our backend's, on the fidelity protocol (issue 54, item 3).

The protocol of :mod:`benchmarks.fidelity_backend`: SmolLM2-135M, the fidelity harness's text
(every ``pydoc_data.topics`` entry, sorted, joined), the first ``context`` tokens as the prompt
(dense prefill), then ``steps`` decode steps each fed the *true* next token of the text. Per
step: the greedy token (argmax of the logits) and the NLL (nats) of the true next token.
**agreement** is the share of steps whose greedy token equals the same engine's dense run's;
**nll_delta** the mean NLL minus dense's.

* **vLLM rows** run in ``.venv-vllm`` (one fresh process per contender): vLLM dense, and vLLM
  with the plugin at each budget. The true tokens are forced by a logits processor
  (:func:`teacher_forcing_class`: every logit but the true token's set to ``-inf``), and the greedy
  token and the NLL are read from vLLM's *raw* log-probabilities (``logprobs_mode=
  "raw_logprobs"``, computed before any logits processor).
* **backend rows** (``--backend``) run here: Hugging Face dense (SDPA, ``DynamicCache``) and
  ``torch.compile(backend="specontext")`` with the plugin's selection (``page_rescue=0``,
  ``candidates=1``: the shared selection, no per-layer refinement) and, for reference, the
  backend's default (the page rescue the plugin does not build yet).

The first generated token comes from the prefill (dense in every row) and is not scored: step
``i`` feeds ``ids[context + i]`` and predicts ``ids[context + i + 1]``. SmolLM2 has 8192
positions, so ``context + steps + 1 <= 8192`` (vLLM refuses longer sequences).

Run from the main venv::

    python -m benchmarks.vllm_fidelity --context 7680 --steps 256 --budgets 1024 --dtypes fp32 --backend \
        --json docs/results/vllm_fidelity_7680x256.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from pathlib import Path

from benchmarks.vllm_serving import (
    DTYPES,
    MODEL_DIR,
    ROOT,
    VENV_PYTHON,
    contender_options,
    prepare_driver,
    write_rows,
)

logger = logging.getLogger("vllm_fidelity")

__all__ = ["agreement", "teacher_forcing_class", "worker"]

_FORCED = "teacher_forced_ids"  # SamplingParams.extra_args key: the tokens to force, in order


def teacher_forcing_class():
    """The ``TeacherForcing`` logits processor class, built on vLLM's per-request adapter (vLLM is
    imported only here: this module also runs in the main venv, without vLLM)."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class TeacherForcing(AdapterLogitsProcessor):
        """Forces ``extra_args["teacher_forced_ids"][k]`` as the ``k``-th generated token of a
        request (a per-request vLLM logits processor). It changes only what is *sampled*:
        vLLM's raw log-probabilities, computed before it runs, still give the model's own
        greedy token and the true token's log-probability."""

        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            forced = (params.extra_args or {}).get(_FORCED)
            if forced is None:
                return None

            def force(output_ids: list[int], logits):
                import torch

                token = forced[min(len(output_ids), len(forced) - 1)]
                out = torch.full_like(logits, float("-inf"))
                out[token] = 0.0
                return out

            return force

    return TeacherForcing




# --------------------------------------------------------------------------- worker (.venv-vllm)


def _harness_ids() -> list[int]:
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return tokenizer(text).input_ids


def worker(job: dict) -> dict:
    """One engine (vLLM dense or the plugin), one dtype, one teacher-forced request."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the processor runs in this process
    from torch._dynamo.utils import counters
    from vllm import LLM, SamplingParams

    context, steps = job["context"], job["steps"]
    ids = _harness_ids()
    options = contender_options(job["contender"])
    llm = LLM(model=str(MODEL_DIR), dtype=job["dtype"], enforce_eager=True, max_model_len=context + steps + 1,
              block_size=32, max_num_seqs=1, kv_cache_memory_bytes=512 * 2**20, enable_prefix_caching=False,
              skip_tokenizer_init=True, logprobs_mode="raw_logprobs",
              logits_processors=[teacher_forcing_class()],
              additional_config={"specontext": options} if options else {})
    forced = ids[context:context + steps + 1]
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=1,
                            extra_args={_FORCED: forced})
    out = llm.generate([{"prompt_token_ids": ids[:context]}], params, use_tqdm=False)[0].outputs[0]
    if list(out.token_ids) != forced:
        raise RuntimeError("the teacher-forcing processor did not force the text's tokens")
    greedy, nll = [], []
    for k in range(1, steps + 1):  # position 0 is the prefill's token
        entry = out.logprobs[k]
        greedy.append(next(t for t, lp in entry.items() if lp.rank == 1))
        nll.append(-entry[forced[k]].logprob)
    return {"engine": "vllm", "contender": job["contender"], "dtype": job["dtype"], "greedy": greedy, "nll": nll,
            "plugin_counters": dict(counters["specontext_vllm"])}


# --------------------------------------------------------------------------- backend rows (main venv)


def _backend_rows(context: int, steps: int, budgets: list[int], dtype: str) -> list[dict]:
    import torch

    from benchmarks.fidelity_backend import dense_run, harness_ids, sparse_run
    from specontext_compile.models import load_model

    model, tok = load_model("smollm2-135m", getattr(torch, dtype))
    ids = harness_ids(tok)
    dense_argmax, dense_nll, _ = dense_run(model, ids, context, steps)
    rows = [{"engine": "backend", "contender": "hf-dense", "dtype": dtype, "greedy": dense_argmax.tolist(),
             "nll": dense_nll.tolist()}]
    for budget in budgets:
        for name, rescue in ((f"specontext-{budget}", 0), (f"specontext-default-{budget}", None)):
            run = sparse_run(model, ids, context, steps, budget=budget, candidates=1.0, page_rescue=rescue)
            rows.append({"engine": "backend", "contender": name, "dtype": dtype, "greedy": run["argmax"].tolist(),
                         "nll": run["nll"].tolist(), "paths": run["paths"]})
    return rows


# --------------------------------------------------------------------------- driver


def agreement(a: list[int], b: list[int]) -> float:
    """Share of positions where ``a`` and ``b`` hold the same token (equal lengths)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"agreement needs two non-empty lists of one length, got {len(a)} and {len(b)}")
    return sum(x == y for x, y in zip(a, b)) / len(a)


def _vllm_row(args, contender: str, dtype: str) -> dict:
    job = {"contender": contender, "dtype": DTYPES[dtype], "context": args.context, "steps": args.steps}
    cmd = [str(VENV_PYTHON), "-m", "benchmarks.vllm_fidelity", "--worker", json.dumps(job)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{contender} {dtype} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _score(rows: list[dict]) -> None:
    """Agreement and NLL delta of every row against its engine's dense row of its dtype."""
    for row in rows:
        dense = next(r for r in rows if r["engine"] == row["engine"] and r["dtype"] == row["dtype"]
                     and r["contender"] in ("vllm-dense", "hf-dense"))
        row["agreement"] = round(agreement(row["greedy"], dense["greedy"]), 4)
        row["nll_delta"] = round(sum(row["nll"]) / len(row["nll"]) - sum(dense["nll"]) / len(dense["nll"]), 4)
    for row in rows:  # the two dense references against each other
        if row["contender"] == "vllm-dense":
            hf = next((r for r in rows if r["contender"] == "hf-dense" and r["dtype"] == row["dtype"]), None)
            if hf is not None:
                row["agreement_vs_hf_dense"] = round(agreement(row["greedy"], hf["greedy"]), 4)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_fidelity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=7680)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024])
    parser.add_argument("--rescues", type=float, nargs="+", default=[0.0],
                        help="the plugin's page_rescue per budget, in multiples of the budget (0 = off; 2 = the "
                             "backend's default)")
    parser.add_argument("--candidates", type=float, nargs="+", default=[1.0],
                        help="the plugin's option candidates, one run per value with every budget and rescue "
                             "(1 = the shared selection; > 1: every layer refines)")
    parser.add_argument("--min-coverages", type=float, nargs="+", default=[0.0],
                        help="the plugin's fidelity guard (option min_coverage), one run per value with every "
                             "budget, rescue and candidates (0 = off)")
    parser.add_argument("--selection-keys", nargs="+", default=["int8"], choices=["int8", "store"],
                        help="what the plugin's selection scores, one run per value: the retrieval layers' int8 "
                             "keys (the default) or vLLM's cache (contender suffix -ks)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=sorted(DTYPES))
    parser.add_argument("--backend", action="store_true", help="add our backend's rows (Hugging Face dense, "
                        "page_rescue=0 and the default at each budget), run in this process")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per vLLM contender")
    parser.add_argument("--json", type=Path, help="write every row (greedy tokens and NLLs included) here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.context + args.steps + 1 > 8192:
        raise SystemExit(f"context + steps + 1 = {args.context + args.steps + 1} is past SmolLM2's 8192 positions")
    prepare_driver()
    rows = []
    for dtype in args.dtypes:
        plugin = [f"specontext-{b}" + (f"-rescue{int(r * b)}" if r else "") + (f"-c{c:g}" if c != 1 else "")
                  + (f"-g{g:g}" if g else "") + ("-ks" if keys == "store" else "")
                  for b in args.budgets for r in args.rescues for c in args.candidates for g in args.min_coverages
                  for keys in args.selection_keys]
        for contender in ["vllm-dense", *plugin]:
            logger.info("vLLM %s %s ...", contender, dtype)
            rows.append(_vllm_row(args, contender, dtype))
        if args.backend:
            logger.info("backend %s ...", dtype)
            rows.extend(_backend_rows(args.context, args.steps, args.budgets, DTYPES[dtype]))
    _score(rows)
    print("| engine | contender | dtype | agreement vs its dense | NLL delta (nats/token) |")
    print("|---|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['contender']} | {r['dtype']} | {r['agreement']} | {r['nll_delta']} |")
    if args.json:
        write_rows(args.json, "benchmarks.vllm_fidelity", argv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
