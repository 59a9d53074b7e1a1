"""The docs' raw figures (issue 53, item 6): every file a page cites is in docs/results/,
every file there is cited by a page, and docs/results/README.md (the index saying which page
cites which file) is current (``scripts/results_index.py``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _index_module():
    spec = importlib.util.spec_from_file_location("results_index", ROOT / "scripts" / "results_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_cited_figure_exists_and_every_figure_is_cited():
    index = _index_module()
    assert index.problems(index.citations()) == []


def test_the_index_is_current():
    index = _index_module()
    assert index.INDEX.read_text() == index.render(index.citations()), "run python scripts/results_index.py"


def test_the_index_reports_a_missing_and_an_uncited_file(tmp_path, monkeypatch):
    """The check can fail: a page citing a file that is not there, and a file no page cites."""
    index = _index_module()
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "kept.json").write_text("{}")
    (tmp_path / "docs" / "results" / "orphan.json").write_text("{}")
    (tmp_path / "README.md").write_text("# top\nsee `docs/results/kept.json` and docs/results/gone_{a,b}.json\n")
    monkeypatch.setattr(index, "ROOT", tmp_path)
    monkeypatch.setattr(index, "RESULTS", tmp_path / "docs" / "results")
    found = index.problems(index.citations())
    assert any("gone_a.json" in p for p in found) and any("gone_b.json" in p for p in found)
    assert any("orphan.json is cited by no page" in p for p in found)
    assert not any("kept.json" in p for p in found)


def test_no_page_cites_a_figure_outside_results():
    index = _index_module()
    outside = re.compile(r"docs/[\w.-]+\.(?:json|png|log)\b")
    cited = {f"{page.name}: {m.group(0)}" for page in index.pages() for m in outside.finditer(page.read_text())}
    assert not cited, sorted(cited)
