"""The CLI never loses the user's work: output paths are made or refused before any model loads,
and the README's main-job command runs end to end on a tiny local model."""

import json
import math
import os
from pathlib import Path

import pytest
from _tiny import save_tiny_hf_folder

from specontext_compile import cli

# Every key `specontext run --json` writes (README "Reading the report", report.RunReport).
RUN_KEYS = {
    "model", "prompt_tokens", "new_tokens", "budget", "sites_total", "sites_rewritten", "retrieval_layers",
    "greedy_agreement", "attention_recall", "decode_ms_sparse", "decode_ms_dense", "speedup", "kv_bytes",
    "text", "candidates", "min_coverage", "page_rescue", "dense_layers", "path_counts",
    "first_token_s", "first_decode_step_s", "compile_cache",
}
PATH_COUNT_KEYS = {"decode_steps", "sparse_sites", "gather_sites", "dense_store_sites", "guard_dense_sites",
                   "page_rescue_sites", "recency_fallback_steps"}


def _no_loading(monkeypatch):
    """Make any model load fail the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the paths were checked")

    monkeypatch.setattr("specontext_compile.models.load_model", forbidden)
    monkeypatch.setattr("specontext_compile.tiny_models.tiny_family", forbidden)


def test_main_job_command_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    """README main job: `run --model M --prompt-file F --budget B --max-new-tokens N --json out/run.json`,
    with out/ (two levels of it) not there yet."""
    import dataclasses

    from specontext_compile.report import RunReport

    assert {f.name for f in dataclasses.fields(RunReport)} == RUN_KEYS
    model = save_tiny_hf_folder(tmp_path / "tiny-llama")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"w{(i * 37) % 128}" for i in range(80)), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out" / "nested" / "run.json"
    assert not out.parent.parent.exists()
    rc = cli.main(["run", "--model", str(model), "--prompt-file", str(prompt), "--budget", "16",
                   "--max-new-tokens", "8", "--json", "out/nested/run.json"])
    assert rc == 0
    assert f"figures written to {'out/nested/run.json'}" in capsys.readouterr().out
    report = json.loads(out.read_text(encoding="utf-8"))
    assert set(report) == RUN_KEYS
    assert report["model"] == str(model)
    assert report["prompt_tokens"] == 80 and report["new_tokens"] == 8 and report["budget"] == 16
    assert report["sites_total"] == 2 and 0 < report["sites_rewritten"] <= report["sites_total"]
    assert report["retrieval_layers"] and all(0 <= layer < 2 for layer in report["retrieval_layers"])
    assert 0.0 <= report["greedy_agreement"] <= 1.0
    assert 0.0 < report["attention_recall"] <= 1.0 + 1e-6
    assert report["compile_cache"] == ""  # no --compile-cache given
    # the first decode call compiles: it takes longer than a compiled step
    assert report["first_decode_step_s"] * 1000 > report["decode_ms_sparse"] and report["first_token_s"] > 0
    for key in ("decode_ms_sparse", "decode_ms_dense", "speedup"):
        assert isinstance(report[key], float) and math.isfinite(report[key]) and report[key] > 0
    assert isinstance(report["kv_bytes"], int) and report["kv_bytes"] > 0
    assert isinstance(report["text"], str) and len(report["text"].split()) == 8
    assert report["candidates"] == 1.0 and report["min_coverage"] == 0.0
    counts = report["path_counts"]
    assert set(counts) == PATH_COUNT_KEYS and all(isinstance(v, int) and v >= 0 for v in counts.values())
    assert counts["decode_steps"] == 7 and counts["sparse_sites"] == 7 * report["sites_rewritten"]
    assert not list(out.parent.glob(".*.tmp"))  # the temporary file of the rename is gone


def test_a_run_past_the_models_positions_is_refused(tmp_path, capsys):
    """The tiny model has 256 positions: 80 prompt tokens + 200 new ones are refused with
    both numbers and the fix, before anything is generated (no figures written)."""
    model = save_tiny_hf_folder(tmp_path / "tiny-llama")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"w{(i * 37) % 128}" for i in range(80)), encoding="utf-8")
    out = tmp_path / "run.json"
    rc = cli.main(["run", "--model", str(model), "--prompt-file", str(prompt), "--budget", "16",
                   "--max-new-tokens", "200", "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "needs 280 positions" in err and "256 (max_position_embeddings" in err, err
    assert "lower --max-new-tokens" in err and not out.exists()


@pytest.mark.parametrize("argv, option", [
    (["run", "--prompt-file", "{prompt}", "--json", "{blocked}/run.json"], "--json"),
    (["explain", "--model", "tiny:llama", "--json", "{blocked}/t.json"], "--json"),
    (["explain", "--model", "tiny:llama", "--dump-dir", "{blocked}/dumps"], "--dump-dir"),
    (["distill", "--text", "{prompt}", "--out", "{blocked}/head"], "--out"),
    (["distill", "--text", "{prompt}", "--out", "{tmp}/head", "--teacher-cache", "{blocked}/t.pt"],
     "--teacher-cache"),
])
def test_unwritable_output_is_refused_before_loading(tmp_path, monkeypatch, capsys, argv, option):
    """A path under a regular file (unwritable even for root) exits 2 naming the option, the
    blocking file and the fix, and nothing is loaded."""
    _no_loading(monkeypatch)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("w1 w2 w3", encoding="utf-8")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder", encoding="utf-8")
    argv = [a.format(prompt=prompt, blocked=blocked / "sub", tmp=tmp_path) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot write {option}" in err and f"{blocked} is a file, not a folder" in err
    assert "pass a path in a folder you can write" in err and f"(e.g. {option} " in err


def test_output_that_is_a_folder_is_refused(tmp_path, monkeypatch, capsys):
    _no_loading(monkeypatch)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("w1", encoding="utf-8")
    assert cli.main(["run", "--prompt-file", str(prompt), "--json", str(tmp_path)]) == 2
    assert "it is a folder; name a file inside it" in capsys.readouterr().err


def test_dump_dir_from_the_environment_is_checked(tmp_path, monkeypatch, capsys):
    _no_loading(monkeypatch)
    blocked = tmp_path / "a-file"
    blocked.write_text("x", encoding="utf-8")
    monkeypatch.setenv("SPECONTEXT_DUMP_DIR", str(blocked))
    assert cli.main(["explain", "--model", "tiny:llama"]) == 2
    assert "cannot write $SPECONTEXT_DUMP_DIR" in capsys.readouterr().err


def test_missing_input_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    _no_loading(monkeypatch)
    assert cli.main(["run", "--prompt-file", str(tmp_path / "nope.txt")]) == 2
    assert "cannot read --prompt-file" in capsys.readouterr().err
    assert cli.main(["distill", "--text", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "h")]) == 2
    assert "cannot read --text" in capsys.readouterr().err


def test_checks_leave_existing_files_unchanged_and_make_parents(tmp_path):
    existing = tmp_path / "keep.json"
    existing.write_text("old figures", encoding="utf-8")
    cli._check_file(existing, "--json", "out/run.json")
    assert existing.read_text(encoding="utf-8") == "old figures"
    fresh = tmp_path / "x" / "y" / "run.json"
    cli._check_file(fresh, "--json", "out/run.json")
    assert fresh.parent.is_dir() and not fresh.exists()  # the folder is made, no empty file is left


def test_a_failed_final_write_keeps_the_figures(tmp_path, capsys):
    target = tmp_path / "gone" / "run.json"
    (tmp_path / "gone").write_text("the folder was replaced by a file", encoding="utf-8")
    assert cli.write_json(target, {"budget": 16}, "figures") == 1
    err = capsys.readouterr().err
    rescue = err.rsplit(" saved to ", 1)[1].split(" instead")[0]
    try:
        assert json.loads(Path(rescue).read_text(encoding="utf-8")) == {"budget": 16}
    finally:
        os.unlink(rescue)


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0"], "'budget' must be an int >= 1"),
    (["--recent-window", "-1"], "'recent_window' must be an int >= 0"),
    (["--candidates", "0.5"], "'candidates' must be a number >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
], ids=["budget", "recent-window", "candidates", "max-new-tokens"])
def test_bad_option_values_are_refused_before_loading(tmp_path, monkeypatch, capsys, argv, message):
    _no_loading(monkeypatch)
    prompt = tmp_path / "p.txt"
    prompt.write_text("some text", encoding="utf-8")
    assert cli.main(["run", "--prompt-file", str(prompt), *argv]) == 2
    assert message in capsys.readouterr().err


def test_json_report_gets_the_usual_file_mode(tmp_path):
    """Written through mkstemp + rename, the report still gets 0666 & ~umask, not 0600."""
    mask = os.umask(0o022)
    try:
        assert cli.write_json(tmp_path / "run.json", {"budget": 16}, "figures") == 0
    finally:
        os.umask(mask)
    assert (tmp_path / "run.json").stat().st_mode & 0o777 == 0o644


def test_json_report_writes_candidates_inf_as_strict_json(tmp_path):
    import json
    import math

    from specontext_compile.cli import write_json

    out = tmp_path / "run.json"
    write_json(out, {"candidates": math.inf, "nested": [1.0, {"x": -math.inf}]}, "report")
    text = out.read_text()
    assert "Infinity" not in text
    assert json.loads(text) == {"candidates": "inf", "nested": [1.0, {"x": "-inf"}]}


@pytest.mark.parametrize("command", ["run", "explain", "serve"])
def test_an_unknown_option_names_the_subcommand_and_its_help(tmp_path, capsys, command):
    """An option the subcommand does not take: exit 2 with that subcommand's usage and a
    pointer to its --help (not the top level's usage)."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    argv = [command, "--frobnicate", "3"] + (["--prompt-file", str(prompt)] if command == "run" else [])
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"specontext {command}: error: unrecognized arguments: --frobnicate 3 (see specontext {command} --help)" in err
