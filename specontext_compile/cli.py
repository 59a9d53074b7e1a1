"""Command line: ``specontext run`` (the main job) and friends.

``python -m specontext_compile run --model smollm2-135m --prompt-file FILE --budget 1024
--max-new-tokens 128 [--retrieval-head DIR] [--json OUT]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from . import cli_distill

from .explain_cli import add_explain_parser, cmd_explain

__all__ = ["main"]


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="generate with the backend and compare with dense decoding")
    run.add_argument("--model", default="smollm2-135m",
                     help="smollm2-135m, a .gguf file or a local Hugging Face folder")
    run.add_argument("--prompt-file", required=True, type=Path, help="text file with the prompt")
    run.add_argument("--budget", type=int, default=1024, help="selected tokens per KV head")
    run.add_argument("--max-new-tokens", type=int, default=128)
    run.add_argument("--sink-tokens", type=int, default=4)
    run.add_argument("--recent-window", type=int, default=64)
    run.add_argument("--retrieval-layers", type=lambda s: tuple(int(x) for x in s.split(",")),
                     default=None, help="comma-separated layers of the lagged-query head")
    run.add_argument("--retrieval-head", default=None, metavar="DIR",
                     help="draft retrieval head folder (config.json + model.safetensors, e.g. from "
                          "`specontext distill --variant embedding`) used instead of the lagged query")
    run.add_argument("--candidates", type=float, default=None,
                     help="two-stage selection: candidate tokens as a multiple of the budget (default: the "
                          "backend's; 1 = one selection shared by every layer)")
    run.add_argument("--min-coverage", type=float, default=None,
                     help="fidelity guard: a layer whose kept tokens hold less of its candidates' attention "
                          "runs dense (0 = off; needs --candidates > 1)")
    run.add_argument("--recall-samples", type=int, default=4, help="decode steps probed for recall")
    run.add_argument("--json", type=Path, default=None, help="also write the figures here")
    run.add_argument("-v", "--verbose", action="store_true")


def _print_report(report, retrieval_head: str | None = None) -> None:
    print("=" * 72)
    print(report.text.strip())
    print("=" * 72)
    rows = [
        ("model", report.model),
        ("prompt tokens", report.prompt_tokens),
        ("new tokens", report.new_tokens),
        ("budget (tokens / KV head)", report.budget),
        ("attention sites rewritten", f"{report.sites_rewritten} / {report.sites_total}"),
        ("selection head", f"draft head {retrieval_head}" if retrieval_head else "lagged query"),
        ("retrieval layers (lagged query)", ",".join(map(str, report.retrieval_layers)) or "-"),
        ("candidates x budget / guard", f"{report.candidates:g} / "
                                        f"{report.min_coverage:g}" if report.min_coverage else
                                        f"{report.candidates:g} / off"),
        ("decode sites sparse / guard-dense", f"{report.path_counts.get('sparse_sites', 0)} / "
                                              f"{report.path_counts.get('guard_dense_sites', 0)}"),
        ("greedy agreement vs dense", f"{report.greedy_agreement:.4f}"),
        ("attention recall", f"{report.attention_recall:.4f}"),
        ("decode ms/token, specontext", f"{report.decode_ms_sparse:.1f}"),
        ("decode ms/token, dense HF eager", f"{report.decode_ms_dense:.1f}"),
        ("speed-up", f"{report.speedup:.2f}x"),
        ("KV store bytes", report.kv_bytes),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _cmd_run(args) -> int:
    from .models import load_model
    from .report import run_report

    from .config import SpeContextConfig

    text = args.prompt_file.read_text(encoding="utf-8")
    if args.json is not None:  # refuse an unwritable path before minutes of work
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise SystemExit(f"specontext: cannot write --json {args.json}: {exc}; pick a writable path")
    head = None
    if args.retrieval_head is not None:  # checked before the model loads
        head = SpeContextConfig(retrieval_head=args.retrieval_head).retrieval_head
    model, tokenizer = load_model(args.model)
    options = {"retrieval_head": head} if head else {}
    for name in ("candidates", "min_coverage"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    SpeContextConfig(**{k: v for k, v in options.items() if k != "retrieval_head"})  # bad values: before loading
    report = run_report(
        model, tokenizer, text, model_name=args.model, budget=args.budget,
        max_new_tokens=args.max_new_tokens, recall_samples=args.recall_samples,
        sink_tokens=args.sink_tokens, recent_window=args.recent_window,
        retrieval_layers=args.retrieval_layers, **options,
    )
    _print_report(report, head)
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specontext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    add_explain_parser(sub)
    cli_distill.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "explain":
            return cmd_explain(args)
        if args.command == "distill":
            return cli_distill.run(args)
        return _cmd_run(args)
    except ValueError as err:
        print(f"specontext: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
