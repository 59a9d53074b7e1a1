"""Graph-inspection tools: ``explain``, ``specontext explain``, graph dumps, pass identity."""

import json

import networkx as nx
import pytest
import torch
from specontext_compile.passes.dump import ENV_VAR, GraphDumper, to_networkx
from specontext_compile.passes.sparse_rewrite import SparseAttentionPass

import specontext_compile as sc
from specontext_compile.cli import main
from specontext_compile.tiny_models import tiny_family
from specontext_compile.runtime.spec import StepSpec


def _ids(n=20):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(0))


def test_explain_reports_every_site_windows_and_selection_placement():
    result = sc.explain(tiny_family("gemma3", "sdpa"), _ids(), budget=64)
    decode = [r for r in result.rows if r.phase == "decode"]
    assert [(r.layer, r.window, r.rewritten) for r in decode] == [(0, 24, True), (1, 0, True)]
    assert all((r.heads, r.kv_heads, r.head_dim, r.q_len) == (4, 2, 16, 1) for r in decode)
    prefill = [r for r in result.rows if r.phase == "prefill"]
    assert len(prefill) == 2 and all(not r.rewritten and r.reason for r in prefill)
    assert result.counters["sites_rewritten"] == 2 and result.counters["sites_total"] == 4
    # one selection, the windowed layer's: the full layer's budget covers its store, so it
    # takes the dense route and reads every slot (its window's selection would go unread)
    assert len(result.selections) == 1
    assert all("after retrieval_anchor" in s and "before the first kv_write" in s for s in result.selections)
    text = result.table()
    assert "rewritten" in text and "pass: specontext-sparse-" in text
    assert sum("dense: " in line and "prefill" in line for line in text.splitlines()) == 2
    # the step's calls (issue 27): the windowed layer's selection and, per layer, the write,
    # the lagged query's record and the attention (no refinement: the budget covers the
    # context), then what the lowering did
    (step,) = result.steps
    assert "scorers.head_select x1" in step and "specontext::sparse_attention x2" in step
    assert "routes: dense x1, gather x1" in step
    assert "aten_step.record_query x2" in step and "refine_selection" not in step
    assert "lowered to aten: 4 op nodes, 0 refine+attend pairs fused" in step  # 2 writes (with their page bounds), 2 attentions


@pytest.mark.slow
def test_explain_shows_mla_rewritten_and_why_mpt_stays_dense():
    """MLA (DeepSeek-V3) decode sites are rewritten; MPT's, split by a graph break inside its
    attention, are still counted, with the reason."""
    mla = sc.explain(tiny_family("deepseek_v3", "eager"), _ids(), budget=64)
    decode = [r for r in mla.rows if r.phase == "decode"]
    assert len(decode) == 2 and all(r.rewritten for r in decode)
    assert all(r.pattern.endswith("+mla") for r in decode)
    assert "feeds 2 of 2 sparse_attention nodes" in mla.table()
    mpt = sc.explain(tiny_family("mpt", "eager"), _ids(), budget=64)
    decode = [r for r in mpt.rows if r.phase == "decode"]
    # one graph per layer's attention half; graphs dynamo already holds from earlier runs in
    # this process are not compiled again, so at least one decode row
    assert decode and not any(r.rewritten for r in decode)
    assert all("graph break inside the attention" in r.reason for r in decode)
    assert "selection: none inserted" in mpt.table()


def test_explain_rejects_bad_inputs():
    model = tiny_family("llama", "sdpa")
    with pytest.raises(ValueError, match="input_ids"):
        sc.explain(model, {"attention_mask": torch.ones(1, 4)})
    with pytest.raises(ValueError, match="unknown specontext option"):
        sc.explain(model, _ids(), bogus=1)


def _check_dumps(folder):
    files = sorted(p.name for p in folder.iterdir())
    decode = [f for f in files if "_decode_" in f]
    assert {f.split("_", 2)[2] for f in decode} >= {"before.txt", "after.txt", "before.dot", "after.dot"}
    stem = decode[0].rsplit("_", 1)[0]
    before = (folder / f"{stem}_before.txt").read_text()
    after = (folder / f"{stem}_after.txt").read_text()
    assert "sparse_attention" not in before and "head_select" not in before
    assert after.count("specontext.sparse_attention") >= 2 and "head_select" in after
    assert after.startswith("# pass specontext-sparse-")
    dot = (folder / f"{stem}_after.dot").read_text()
    assert dot.startswith('digraph "after"') and "fillcolor=orange" in dot and "fillcolor=palegreen" in dot


def test_dump_dir_option_writes_text_and_dot(tmp_path):
    # a budget under the cache's capacity: a step whose sites all attend over their whole store
    # makes no selection (sparse_rewrite._selection_unused)
    sc.explain(tiny_family("llama", "eager"), _ids(), budget=8, dump_dir=str(tmp_path))
    _check_dumps(tmp_path)


@pytest.mark.slow
def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    sc.explain(tiny_family("qwen3", "sdpa"), _ids(), budget=8)
    _check_dumps(tmp_path / "env")


def test_no_dumps_unless_asked(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert GraphDumper.from_option(None) is None


def test_networkx_view_matches_the_fx_graph():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
    dag = to_networkx(gm.graph)
    assert nx.is_directed_acyclic_graph(dag)
    assert dag.number_of_nodes() == len(gm.graph.nodes)
    assert dag.number_of_edges() == sum(len(n.all_input_nodes) for n in gm.graph.nodes)


def test_pass_uuid_is_stable_and_covers_config():
    def make(retrieval_layers=None, max_sparse_q_len=1, **step):
        spec = StepSpec(**{"budget": 64, "candidate_slots": 64, "sink_tokens": 4, "recent_window": 8, **step})
        return SparseAttentionPass(spec, retrieval_layers, max_sparse_q_len)

    assert make().uuid() == make().uuid()
    assert len({make().uuid(), make(budget=65, candidate_slots=65).uuid(), make(sink_tokens=0).uuid(),
                make(recent_window=9).uuid(), make(retrieval_layers=(1,)).uuid(),
                make(max_sparse_q_len=4).uuid(), make(kernel="triton").uuid()}) == 7


@pytest.mark.slow  # fast tier: explain by test_explain_reports_every_site_windows_..., the CLI by test_cli.py
def test_cli_explain_on_a_tiny_family(tmp_path, capsys):
    out = tmp_path / "sites.json"
    assert main(["explain", "--model", "tiny:mistral", "--attn", "eager", "--budget", "64",
                 "--prompt-tokens", "20", "--json", str(out), "--dump-dir", str(tmp_path / "dumps")]) == 0
    printed = capsys.readouterr().out
    assert "rewritten" in printed and "window=24" in printed
    data = json.loads(out.read_text())
    decode = [s for s in data["sites"] if s["phase"] == "decode"]
    assert [(s["layer"], s["window"], s["pattern"], s["rewritten"]) for s in decode] == [
        (0, 24, "eager", True), (1, 24, "eager", True)]
    assert any(p.suffix == ".dot" for p in (tmp_path / "dumps").iterdir())


def test_cli_explain_unknown_family_is_a_clear_error(capsys):
    assert main(["explain", "--model", "tiny:nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown family 'nope'" in err and "llama, mistral" in err  # names the fix: the families


def test_explain_prints_the_offload_plan_thresholds_and_bytes_per_step():
    """With device_memory_bytes, explain shows the memory model (issue 15 item 5): its
    description with the thresholds ST[i], and per decode step the layers offloaded and the
    expected device bytes, equal to the model's own prediction."""
    from _tiny import tiny_llama
    from specontext_compile.runtime.offload import minimum_device_bytes

    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    memory = minimum_device_bytes(model, 16, tokens=42)  # room for 42 tokens fully offloaded
    result = sc.explain(model, ids, decode_steps=2, budget=16, recent_window=4, sink_tokens=2,
                        device_memory_bytes=memory, inner="eager", page_rescue=0)
    plan = result.offload
    assert plan is not None and len(plan["thresholds"]) == 3 and len(plan["steps"]) == 2
    assert all(s["offloaded"] >= 1 for s in plan["steps"])  # 40+ tokens do not fit resident
    text = result.table()
    assert "offload: memory model: device" in text and "ST[0]=" in text
    assert "expected device bytes" in text
    for s in plan["steps"]:
        assert s["device_bytes"] <= memory
    assert result.to_dict()["offload"]["steps"][0]["length"] == 41
    (step,) = result.steps  # an offloaded site's arithmetic is the step's own code (issue 27 item 5)
    assert "offload_step.attention x2" in step and "specontext::offload_prefetch x2" in step
