"""Durations of a pytest run, by file and by test, from pytest's JUnit XML report.

Usage (docs/testing.md has the commands that made its tables)::

    .venv/bin/python -m pytest -q --slow --junitxml=out/full.xml
    python scripts/test_durations.py out/full.xml --json docs/testing/durations_full.json --top 40

Prints two Markdown tables (files by total seconds, then the slowest tests) and, with
``--json``, writes every test's duration (seconds: setup + call + teardown, as pytest's
JUnit report counts them), outcome and tier (``slow`` where the test is in the slow tier,
given by ``--slow-ids``: a file with one test id per line, e.g. from ``pytest --collect-only
-q -m slow``).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def read_junit(path: Path) -> list[dict]:
    """One dict per test case: ``id`` (``tests/file.py::name[param]``), ``file``, ``seconds``,
    ``outcome`` (passed, failed, error, skipped)."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x[.TestClass]
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        file = "/".join(parts[:module + 1]) + ".py"
        name = "::".join([*parts[module + 1:], case.get("name", "")])
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        rows.append({"id": f"{file}::{name}", "file": file,
                     "seconds": float(case.get("time", 0.0)), "outcome": outcome})
    return rows


def by_file(rows: list[dict]) -> list[tuple[str, int, float]]:
    """(file, tests, seconds) sorted by seconds, largest first."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for row in rows:
        totals[row["file"]][0] += 1
        totals[row["file"]][1] += row["seconds"]
    return sorted(((f, n, s) for f, (n, s) in totals.items()), key=lambda t: -t[2])


def markdown(rows: list[dict], top: int) -> str:
    """The by-file table and the ``top`` slowest tests, as Markdown."""
    total = sum(r["seconds"] for r in rows)
    lines = [f"{len(rows)} tests, {total:.0f} s in tests ({total / 60:.1f} min)", "",
             "| file | tests | seconds | share |", "|---|---:|---:|---:|"]
    lines += [f"| {f} | {n} | {s:.1f} | {100 * s / total:.1f}% |" for f, n, s in by_file(rows)]
    lines += ["", f"| slowest {top} tests | seconds | tier |", "|---|---:|---|"]
    for row in sorted(rows, key=lambda r: -r["seconds"])[:top]:
        lines.append(f"| `{row['id']}` | {row['seconds']:.1f} | {row.get('tier', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, help="pytest --junitxml report")
    parser.add_argument("--json", type=Path, help="write every test's duration here")
    parser.add_argument("--top", type=int, default=30, help="slowest tests to list")
    parser.add_argument("--slow-ids", type=Path, help="file of the slow tier's test ids, one a line")
    args = parser.parse_args(argv)
    rows = read_junit(args.junit)
    if args.slow_ids is not None:
        slow = {line.strip() for line in args.slow_ids.read_text().splitlines() if "::" in line}
        for row in rows:
            row["tier"] = "slow" if row["id"] in slow else "fast"
    sys.stdout.write(markdown(rows, args.top) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"source": str(args.junit), "tests": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
