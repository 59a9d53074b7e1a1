"""Retrieval heads shipped with the package (distilled by ``specontext distill``).

Each head is a folder ``<model>-<variant>/`` in the EAGLE-3 layout (``config.json`` +
``model.safetensors``) without ``embed_tokens``: the target model's embedding is passed at
load time. How each was trained and how well it does is in this folder's ``README.md``.

    from specontext_compile.runtime import heads
    head, report = heads.load("smollm2-135m-fused", model.model.embed_tokens.weight)
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["available", "load", "path_of"]

_HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    """Names of the shipped heads (folders holding a ``config.json``), sorted."""
    return sorted(p.name for p in _HERE.iterdir() if (p / "config.json").is_file())


def path_of(name: str) -> Path:
    """Folder of the shipped head ``name`` (e.g. ``"smollm2-135m-fused"``).

    Raises:
        ValueError: no such head (the message lists the shipped ones).
    """
    folder = _HERE / name
    if name not in available():
        raise ValueError(f"no shipped retrieval head {name!r}; shipped: {available()}")
    return folder


def load(name: str, target_embedding: torch.Tensor):
    """Load the shipped head ``name`` with the target's ``[vocab, hidden]`` embedding.

    Returns:
        ``(Eagle3RetrievalHead, PruneReport)`` as
        :func:`~specontext_compile.runtime.eagle3.load_eagle3_head`.
    """
    from ..eagle3 import load_eagle3_head

    return load_eagle3_head(path_of(name), target_embedding=target_embedding)
