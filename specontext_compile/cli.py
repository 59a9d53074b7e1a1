"""Command line: ``specontext run`` (the main job) and friends.

``python -m specontext_compile run --model smollm2-135m --prompt-file FILE --budget 1024
--max-new-tokens 128 [--retrieval-head DIR] [--json OUT]``
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
from pathlib import Path

from . import cli_distill, cli_serve
from .cli_json import write_json
from .explain_cli import add_explain_parser, cmd_explain

__all__ = ["check_paths", "main", "write_json"]

# Paths each command writes: (argparse dest, option as typed, "file" or "dir", example for the message).
_OUTPUTS = {
    "run": (("json", "--json", "file", "out/run.json"),
            ("compile_cache", "--compile-cache", "file", "out/compile_cache.bin")),
    "explain": (("json", "--json", "file", "out/explain.json"),
                ("dump_dir", "--dump-dir", "dir", "out/dumps")),
    "distill": (("out", "--out", "dir", "out/head"),
                ("teacher_cache", "--teacher-cache", "file", "out/teacher.pt")),
}
# Files each command reads before it loads the model: (dest, option as typed).
_INPUTS = {"run": (("prompt_file", "--prompt-file"),), "distill": (("text", "--text"),)}
_DUMP_ENV = "SPECONTEXT_DUMP_DIR"  # passes/dump.py: graph dumps when no --dump-dir is given


def _existing_ancestor(path: Path) -> Path:
    """The nearest of ``path`` and its parents that exists (``.`` at worst)."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(".")


def _refuse(option: str, path: Path, why: str, example: str) -> ValueError:
    return ValueError(f"cannot write {option} {path}: {why}; pass a path in a folder you can write "
                      f"(e.g. {option} {example})")


def _check_folder(path: Path, option: str, example: str) -> None:
    """Create ``path`` (and its parents) and prove a file can be made in it; nothing is left behind."""
    ancestor = _existing_ancestor(path)
    if not ancestor.is_dir():
        raise _refuse(option, path, f"{ancestor} is a file, not a folder", example)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise _refuse(option, path, f"{exc.strerror or exc} ({exc.filename or path})", example) from None


def _check_file(path: Path, option: str, example: str) -> None:
    """Create the parent folders of ``path`` and prove ``path`` writable without changing it:
    an existing file is opened for appending (nothing appended), a new one is made and removed."""
    if path.is_dir():
        raise _refuse(option, path, "it is a folder; name a file inside it", f"{path / Path(example).name}")
    _check_folder(path.parent, option, example)
    try:
        if os.path.lexists(path):
            with open(path, "ab"):
                pass
        else:
            with open(path, "xb"):
                pass
            os.unlink(path)
    except OSError as exc:
        raise _refuse(option, path, exc.strerror or str(exc), example) from None


def check_paths(args) -> None:
    """Refuse, before any model loads, what a command could not read or write at its end.

    Output files get their parent folders created and are proved writable; output folders are
    created and proved writable (``$SPECONTEXT_DUMP_DIR`` too, when it will be used); input
    files must be readable.

    Raises:
        ValueError: naming the option, the path, why, and what to pass instead.
    """
    for dest, option in _INPUTS.get(args.command, ()):
        value = getattr(args, dest, None)
        for path in value if isinstance(value, list) else [value] if value is not None else []:
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ValueError(f"cannot read {option} {path}: "
                                 f"{'no such file' if not path.exists() else 'not a readable file'}")
    for dest, option, kind, example in _OUTPUTS.get(args.command, ()):
        value = getattr(args, dest, None)
        if value is not None:
            (_check_file if kind == "file" else _check_folder)(Path(value), option, example)
    dumps = args.command in ("run", "explain") and not getattr(args, "dump_dir", None)
    if dumps and os.environ.get(_DUMP_ENV):
        _check_folder(Path(os.environ[_DUMP_ENV]), f"${_DUMP_ENV}", "out/dumps")


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
                          "backend's; 1 = one selection shared by every layer; inf = each layer's exact top budget)")
    run.add_argument("--min-coverage", type=float, default=None,
                     help="fidelity guard: a layer whose kept tokens hold less of its candidates' attention "
                          "runs dense (0 = off; needs --candidates > 1 or the page rescue)")
    run.add_argument("--page-rescue", type=int, default=None, metavar="TOKENS",
                     help="tokens each layer adds to the candidates from the pages its own query ranks highest "
                          "(Quest bounds; 0 = off); e.g. --candidates 4 --page-rescue 1024")
    run.add_argument("--dense-layers", type=int, nargs="+", default=None, metavar="LAYER",
                     help="KV (attention) layers kept dense (exact; negative counts from the end), e.g. "
                          "--dense-layers 0 -1")
    run.add_argument("--dense-below", type=int, default=None, metavar="TOKENS",
                     help="attend densely over KV stores of at most TOKENS tokens (exact; below the context "
                          "where sparse gets faster on your machine); default 0: always sparse")
    run.add_argument("--recall-samples", type=int, default=4, help="decode steps probed for recall")
    run.add_argument("--json", type=Path, default=None, help="also write the figures here")
    run.add_argument("--compile-cache", type=Path, default=None, metavar="FILE",
                     help="compiled steps reused across processes and machines: loaded before the run when the "
                          "file exists, saved after it (torch's cache artifacts; compile_cache.py)")
    run.add_argument("-v", "--verbose", action="store_true")


def _print_report(report, retrieval_head: str | None = None) -> None:
    print("=" * 25 + " generated (sparse, greedy) " + "=" * 19)
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
        ("decode sites sparse / guard-dense", (f"{report.path_counts.get('sparse_sites', 0)} / "
                                               f"{report.path_counts.get('guard_dense_sites', 0)}")),
        ("page rescue (tokens) / rescued sites", (f"{report.page_rescue} / "
                                                  f"{report.path_counts.get('page_rescue_sites', 0)}")),
        ("decode steps / recency fallbacks", (f"{report.path_counts.get('decode_steps', 0)} / "
                                              f"{report.path_counts.get('recency_fallback_steps', 0)}")),
        ("layers kept dense (option)", ",".join(map(str, report.dense_layers)) or "-"),
        ("greedy agreement vs dense", f"{report.greedy_agreement:.4f}"),
        ("attention recall", f"{report.attention_recall:.4f}"),
        ("first token s (prefill call)", f"{report.first_token_s:.1f}"),
        ("first decode step s (its compile)", f"{report.first_decode_step_s:.1f}"
                                              + (f" (compile cache {report.compile_cache})" if report.compile_cache else "")),
        ("decode ms/token, specontext", f"{report.decode_ms_sparse:.1f}"),
        ("decode ms/token, dense HF eager", f"{report.decode_ms_dense:.1f}"),
        ("speed-up", f"{report.speedup:.2f}x"),
        ("KV store bytes", report.kv_bytes),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _cmd_run(args) -> int:
    from .config import SpeContextConfig
    from .models import load_model
    from .report import run_report

    text = args.prompt_file.read_text(encoding="utf-8")  # paths: checked by main() (check_paths)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    options = {}
    for name in ("candidates", "min_coverage", "page_rescue", "dense_layers", "dense_below"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    # every option value is checked before the model loads (a bad one costs seconds, not minutes)
    config = SpeContextConfig(budget=args.budget, sink_tokens=args.sink_tokens, recent_window=args.recent_window,
                              retrieval_layers=args.retrieval_layers, retrieval_head=args.retrieval_head,
                              **options)
    head = config.selection.retrieval_head
    if head:
        options["retrieval_head"] = head
    model, tokenizer = load_model(args.model)
    cached = None
    if args.compile_cache is not None:
        from . import compile_cache

        cached = "loaded" if compile_cache.load(args.compile_cache) else "missing"
    report = run_report(
        model, tokenizer, text, model_name=args.model, budget=args.budget,
        max_new_tokens=args.max_new_tokens, recall_samples=args.recall_samples,
        sink_tokens=args.sink_tokens, recent_window=args.recent_window,
        retrieval_layers=args.retrieval_layers, **options,
    )
    if cached is not None:
        report.compile_cache = cached
        compile_cache.save(args.compile_cache)
    _print_report(report, head)
    if args.json:
        return write_json(args.json, dataclasses.asdict(report), "figures")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specontext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    add_explain_parser(sub)
    cli_distill.add_parser(sub)
    cli_serve.add_parser(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage and its --help, not the top level's
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)} "
                                        f"(see specontext {args.command} --help)")
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        check_paths(args)  # before any model loads: minutes of work must not end in an unwritable path
        if args.command == "explain":
            return cmd_explain(args)
        if args.command == "distill":
            return cli_distill.run(args)
        if args.command == "serve":
            return cli_serve.run(args)
        return _cmd_run(args)
    except ValueError as err:
        print(f"specontext {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
