"""Graph dumps before and after the rewrite, as readable text and as DOT (built with networkx).

Off unless the ``dump_dir`` option or the ``SPECONTEXT_DUMP_DIR`` environment variable names
a folder. Per graph the backend hands over, four files are written there:

    NNN_<phase>_before.txt   NNN_<phase>_after.txt    (FX code and the node table)
    NNN_<phase>_before.dot   NNN_<phase>_after.dot    (data-flow DAG; specontext ops coloured)

and ``NNN_<phase>_after.svg`` too when Graphviz's ``dot`` program is on the PATH. ``NNN``
counts graphs in this process; ``<phase>`` is ``decode``, ``prefill`` or ``none``. Paths are
logged at INFO on ``specontext_compile.passes.dump`` (standard logging, no handler added).
The same before/after code also goes to torch's structured trace (``TORCH_TRACE``, for
``tlparse``) and the ``specontext_graphs`` log artifact, without ``dump_dir`` (see
``specontext_compile/logs.py``); ``<phase>`` ``none`` is a graph with no resolved KV store.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
from pathlib import Path

import networkx as nx
from torch import fx

logger = logging.getLogger(__name__)

__all__ = ["ENV_VAR", "GraphDumper", "dump_dir_from", "graph_text", "to_dot", "to_networkx"]

ENV_VAR = "SPECONTEXT_DUMP_DIR"
_COUNTER = itertools.count()
_COLOURS = {  # specontext ops by role
    "kv_write": "lightblue", "retrieval_anchor": "khaki", "record_query": "khaki",
    "head_select": "orange", "sparse_attention": "palegreen",
}


def dump_dir_from(option: str | None) -> Path | None:
    """The dump folder: the option if set, else ``$SPECONTEXT_DUMP_DIR``, else None (off)."""
    value = option or os.environ.get(ENV_VAR)
    return Path(value) if value else None


def _target_name(node: fx.Node) -> str:
    if node.op in ("call_function",):
        return getattr(node.target, "__name__", None) or str(node.target)
    return str(node.target)


def _specontext_role(node: fx.Node) -> str | None:
    name = f"{getattr(node.target, '__module__', '')}.{_target_name(node)}"
    if node.op == "call_function" and "specontext" in name:
        return next((role for role in _COLOURS if role in name), None)
    return None


def graph_text(graph: fx.Graph) -> str:
    """Readable text: one line per node (index, op, name, target, shape) then the FX code."""
    lines = []
    for i, node in enumerate(graph.nodes):
        val = node.meta.get("example_value", node.meta.get("val"))
        shape = f" {tuple(val.shape)} {val.dtype}" if hasattr(val, "shape") and hasattr(val, "dtype") else ""
        lines.append(f"{i:5d}  {node.op:<14} {node.name:<40} {_target_name(node)}{shape}")
    return "\n".join(lines) + "\n\n" + graph.python_code("self").src


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """The FX graph as a networkx DAG: one vertex per node (attributes ``op``, ``target``,
    ``index``, ``role``), one edge per data use (producer -> consumer)."""
    dag = nx.DiGraph()
    for i, node in enumerate(graph.nodes):
        dag.add_node(node.name, op=node.op, target=_target_name(node), index=i, role=_specontext_role(node))
    for node in graph.nodes:
        for src in node.all_input_nodes:
            dag.add_edge(src.name, node.name)
    return dag


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(dag: nx.DiGraph, title: str = "graph") -> str:
    """DOT text of :func:`to_networkx`'s DAG (specontext ops filled by role)."""
    out = [f"digraph {_quote(title)} {{", "  rankdir=TB;", '  node [shape=box, fontsize=10];']
    for name, attrs in dag.nodes(data=True):
        label = f"{name}\\n{attrs['target']}" if attrs["op"] == "call_function" else f"{name}\\n{attrs['op']}"
        style = f', style=filled, fillcolor={_COLOURS[attrs["role"]]}' if attrs.get("role") else ""
        out.append(f"  {_quote(name)} [label={_quote(label)}{style}];")
    out += [f"  {_quote(a)} -> {_quote(b)};" for a, b in dag.edges()]
    out.append("}")
    return "\n".join(out) + "\n"


class GraphDumper:
    """Writes the before/after dumps of one graph (see the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.index = next(_COUNTER)

    @classmethod
    def from_option(cls, option: str | None) -> GraphDumper | None:
        folder = dump_dir_from(option)
        return None if folder is None else cls(folder)

    def snapshot(self, graph: fx.Graph) -> tuple[str, str]:
        """Text and DOT of ``graph`` now (call before the pass mutates it)."""
        return graph_text(graph), to_dot(to_networkx(graph), "before")

    def write(self, before: tuple[str, str], graph: fx.Graph, phase: str, header: str = "") -> list[Path]:
        """Write the before snapshot and ``graph`` as it is now; returns the paths."""
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = f"{self.index:03d}_{phase}"
        after_dot = to_dot(to_networkx(graph), "after")
        files = {
            f"{stem}_before.txt": header + before[0], f"{stem}_before.dot": before[1],
            f"{stem}_after.txt": header + graph_text(graph), f"{stem}_after.dot": after_dot,
        }
        paths = []
        for name, text in files.items():
            path = self.folder / name
            path.write_text(text, encoding="utf-8")
            paths.append(path)
        dot = shutil.which("dot")
        if dot is not None:
            svg = self.folder / f"{stem}_after.svg"
            try:
                subprocess.run([dot, "-Tsvg", str(self.folder / f"{stem}_after.dot"), "-o", str(svg)],
                               check=True, capture_output=True, timeout=60)
                paths.append(svg)
            except (subprocess.SubprocessError, OSError) as err:
                logger.warning("specontext: could not render %s with Graphviz: %s", svg, err)
        logger.info("specontext: graph %s dumped to %s", stem, self.folder)
        return paths
