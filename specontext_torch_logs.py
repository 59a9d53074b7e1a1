"""``torch.backends`` autoload hook of specontext: registers the ``specontext`` log name and
artifacts with ``torch._logging`` before ``import torch`` parses ``TORCH_LOGS``.

A top-level module on purpose: torch runs this hook inside ``import torch``, where importing
the ``specontext_compile`` package (transformers, our ops) would be slow and circular. Unless
``TORCH_LOGS`` names ``specontext``, a ``specontext_*`` artifact or ``help``, it returns
without loading anything. See ``specontext_compile/logs.py`` for the names and the rules.
"""

from __future__ import annotations

import os


def register_if_requested() -> None:
    if "specontext" not in os.environ.get("TORCH_LOGS", "") and "help" not in os.environ.get("TORCH_LOGS", ""):
        return
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("specontext_compile")  # finds, does not import
    if package is None or not package.submodule_search_locations:
        return
    path = Path(next(iter(package.submodule_search_locations))) / "logs.py"
    spec = importlib.util.spec_from_file_location("_specontext_torch_logs_impl", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.torch_autoload()
