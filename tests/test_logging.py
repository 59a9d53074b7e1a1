"""PyTorch logging: the ``specontext`` log name and artifacts (``TORCH_LOGS``), structured
artifacts in ``TORCH_TRACE`` (what ``tlparse`` reads), and log lines that name the layer and
the graph phase.

torch parses ``TORCH_LOGS`` inside ``import torch``, so ``TORCH_LOGS=specontext`` needs the
``torch.backends`` autoload hook (``specontext_torch_logs.py``, see
``specontext_compile/logs.py``). When the installed distribution does not declare it, the
subprocess tests declare it themselves: a throwaway ``*.dist-info`` with that entry point and
a copy of the hook module on ``PYTHONPATH``, which is exactly what installing it does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch._logging._internal as torch_logs
from specontext_compile.passes.sites import AttentionSite
from specontext_compile.passes.sparse_rewrite import RewriteResult
from torch import fx

from specontext_compile import backend, logs

ROOT = Path(__file__).resolve().parents[1]
HOOK = "specontext_torch_logs"

SCRIPT = """
import torch
{imports}
model = {model}
compiled = torch.compile(model.forward, backend="specontext", options={{"budget": 8, "inner": "eager"}})
ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    kwargs = {cache}
    logits = compiled(input_ids=ids, **kwargs).logits[:, -1]
    {decode}
print("DONE")
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a child interpreter, with the autoload hook declared."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_LOGS") and k != "TORCH_TRACE"}
    if not any(ep.value.startswith(HOOK + ":") for ep in entry_points(group="torch.backends")):
        site = tmp_path / "hook"
        info = site / "specontext_torch_logs_test-0.0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: specontext-torch-logs-test\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[torch.backends]\nspecontext_logs = {HOOK}:register_if_requested\n")
        shutil.copy(ROOT / f"{HOOK}.py", site / f"{HOOK}.py")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _run(code: str, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code], check=False, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def _assert_no_unnamed(text: str) -> None:
    assert "layer None" not in text and "none graph" not in text, text[-2000:]


def test_log_name_and_trace_artifacts_on_tiny_llama(tmp_path):
    """``TORCH_LOGS=specontext`` shows our INFO lines (layer and phase named), and
    ``TORCH_TRACE`` holds the graph before/after and the site table per compiled graph."""
    code = SCRIPT.format(
        imports="from specontext_compile import SpeContextCache\nfrom specontext_compile.tiny_models import tiny_family",
        model='tiny_family("llama", "sdpa")',
        cache='{"past_key_values": SpeContextCache(model.config, max_cache_len=32), "use_cache": True}',
        decode="logits = compiled(input_ids=logits.argmax(-1, keepdim=True), **kwargs).logits[:, -1]")
    trace = tmp_path / "trace"
    out = _run(code, _env(tmp_path, TORCH_LOGS="specontext", TORCH_TRACE=str(trace)), tmp_path)
    assert "DONE" in out
    assert "specontext: prefill graph, site of layer 0 stays dense: prefill" in out
    assert "specontext: prefill graph, site of layer 1 stays dense" in out
    assert "specontext: decode graph, 2/2 attention sites rewritten" in out
    assert "__specontext_graphs" not in out  # artifacts are DEBUG: not at INFO
    _assert_no_unnamed(out)
    (log,) = trace.glob("*.log")
    text = log.read_text()
    for name in (logs.TRACE_GRAPH_BEFORE, logs.TRACE_GRAPH_AFTER, logs.TRACE_SITES):
        assert text.count(f'"name": "{name}"') == 2, name  # prefill and decode graph
    tables = re.findall(r'"name": "specontext_sites", "encoding": "json"}.*\n((?:\t.*\n)+)', text)
    rows = [json.loads("".join(line[1:] for line in table.splitlines(keepends=True))) for table in tables]
    assert [[(r["layer"], r["phase"], r["rewritten"]) for r in t] for t in rows] == [
        [(0, "prefill", False), (1, "prefill", False)], [(0, "decode", True), (1, "decode", True)]]
    assert rows[0][0]["reason"].startswith("prefill") and rows[1][0]["reason"] is None
    assert "specontext::sparse_attention" in text or "torch.ops.specontext.sparse_attention" in text


def test_debug_level_via_entry_point_without_import(tmp_path):
    """``TORCH_LOGS=+specontext`` with the backend loaded by dynamo's entry point only (no
    import of our package): DEBUG artifacts shown, unresolved sites named by node."""
    code = SCRIPT.format(
        imports="from transformers import LlamaConfig, LlamaForCausalLM",
        model=("LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, "
               "num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)).eval()"),
        cache='{"use_cache": False}', decode="pass")
    code = code.replace("print(\"DONE\")", "import sys\nprint('DONE', 'specontext_compile' in sys.modules)")
    out = _run(code, _env(tmp_path, TORCH_LOGS="+specontext"), tmp_path)
    assert "DONE True" in out  # dynamo imported the backend through its entry point
    assert "[__specontext_graphs] specontext: graph before the rewrite:" in out
    assert "[__specontext_sites] specontext: 2 attention sites (graph without a resolved KV store)" in out
    assert re.search(r"graph without a resolved KV store, site of unresolved store \(node \w+\) stays dense", out)
    _assert_no_unnamed(out)


def test_help_lists_our_names(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import torch"], check=False, env=_env(tmp_path, TORCH_LOGS="help"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "\n  specontext\n" in done.stderr
    assert re.search(r"specontext_graphs\s+\tGraph code before and after", done.stderr)
    assert re.search(r"specontext_sites\s+\tPer-site table", done.stderr)


def test_registration_in_process_leaves_standard_logging_alone():
    """Without ``TORCH_LOGS`` naming us, importing the backend registers the artifact names
    only: our loggers keep propagating to the root logger (``caplog``, ``basicConfig``)."""
    assert "TORCH_LOGS" not in os.environ or not logs.requested()
    assert torch_logs.log_registry.is_artifact(logs.SITES) and torch_logs.log_registry.is_artifact(logs.GRAPHS)
    assert not torch_logs.log_registry.is_log(logs.LOG_NAME)
    backend_logger = logging.getLogger("specontext_compile")
    assert backend_logger.propagate and not backend_logger.handlers
    logs.register()
    logs.register()  # idempotent
    assert not torch_logs.log_registry.is_log(logs.LOG_NAME)


@pytest.mark.parametrize("setting, expected", [
    ("specontext", True), ("+specontext", True), ("dynamo,-specontext", True), ("specontext_sites", True),
    ("help", True), ("'+specontext, inductor'", True), ("+specontext_compile", False), ("dynamo", False),
    ("", False)])
def test_requested(setting, expected):
    assert logs.requested(setting) is expected


def test_messages_name_layer_and_phase(caplog):
    """Unit: labels for a graph without attention, an unresolved store, a resolved layer."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.relu, (x,))
    unresolved = AttentionSite(node=node, reason="keys computed from the KV store by other ops")
    assert RewriteResult(sites=[]).phase_label == "graph without attention"
    assert RewriteResult(sites=[unresolved]).phase_label == "graph without a resolved KV store"
    assert RewriteResult.site_label(unresolved) == "unresolved store (node relu)"
    resolved = AttentionSite(node=node, layer=3, reason="prefill")
    result = RewriteResult(sites=[unresolved, resolved], phase="prefill")
    with caplog.at_level("INFO", logger="specontext_compile.backend"):
        backend._log_result(RewriteResult(sites=[unresolved]))
        backend._log_result(result)
    assert ("graph without a resolved KV store, site of unresolved store (node relu) stays dense: keys "
            "computed") in caplog.text
    assert "prefill graph, site of layer 3 stays dense: prefill" in caplog.text
    _assert_no_unnamed(caplog.text)
