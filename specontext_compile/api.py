"""Public helpers: make a Hugging Face model generate through the specontext backend."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from .config import SpeContextConfig, flatten_options
from .runtime.key_mirror import DEFAULT_SELECTION_KEYS
from .runtime.kv_cache import SpeContextCache

logger = logging.getLogger(__name__)

__all__ = ["compile", "generation_compile_config", "make_cache", "restore"]


def make_cache(model: torch.nn.Module, input_ids: torch.Tensor | None = None,
               max_new_tokens: int | None = None, max_length: int | None = None,
               retrieval_head: str | None = None) -> SpeContextCache:
    """A :class:`SpeContextCache` sized for one ``generate`` call.

    Capacity = prompt tokens + ``max_new_tokens`` (or the generation config's
    ``max_length``), so compiled decoding never has to grow the store.
    ``retrieval_head``: the draft head folder whose key cache the cache keeps; None takes
    the one ``model`` was compiled with by :func:`compile` (if any). The cache keeps the
    int8 selection keys unless ``model`` was compiled with ``selection_keys="store"``.

    Raises:
        ValueError: a bad ``retrieval_head`` (see ``SpeContextConfig.retrieval_head``).
    """
    options = flatten_options(getattr(model, "_specontext_options", {}))
    if retrieval_head is None:
        retrieval_head = options.get("retrieval_head")
    gen = getattr(model, "generation_config", None)
    prompt = 0 if input_ids is None else input_ids.shape[-1]
    if max_new_tokens is None and gen is not None:
        max_new_tokens = gen.max_new_tokens
    if max_new_tokens is not None:
        total = prompt + max_new_tokens
    else:
        total = max(prompt + 1, max_length or getattr(gen, "max_length", 0) or 0)
    # the int8 keys the option selection_keys="int8" scores are kept by the cache
    return SpeContextCache(model.config, max_cache_len=total + 1, retrieval_head=retrieval_head,
                           selection_keys=options.get("selection_keys", DEFAULT_SELECTION_KEYS),
                           retrieval_layers=options.get("retrieval_layers"))


def compile(model: torch.nn.Module, *, dynamic: bool | None = None, **options: Any) -> torch.nn.Module:
    """Compile ``model.forward`` with ``backend="specontext"`` and make ``generate`` use it.

    After this, ``model.generate(input_ids, max_new_tokens=N)`` runs prefill and every
    decode step through the rewritten graph, with a :class:`SpeContextCache` sized for the
    call (unless the caller passes ``cache=``). The model is changed in place and returned.

    Args:
        model: a Hugging Face causal LM.
        dynamic: passed to ``torch.compile``.
        **options: backend options, see :class:`SpeContextConfig`.

    Raises:
        ValueError: for unknown options or bad values (before anything is compiled);
            ``DeviceMemoryError`` (a ``ValueError``) when ``device_memory_bytes`` cannot
            hold even the model's fixed part, naming the minimum.
    """
    config = SpeContextConfig.from_options(options)
    if isinstance(config.offload.device_memory_bytes, int):  # refuse a tier that can never work, now
        from .runtime.offload import check_device_memory, resident_layer_indices

        text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        layers = text.num_hidden_layers
        check_device_memory(model, config.offload.device_memory_bytes, config.buffer_tokens,
                            resident_layers=len(resident_layer_indices(config.selection.dense_layers, layers)))
    model._specontext_options = dict(options)
    if getattr(model, "_specontext_original", None) is None:
        model._specontext_original = (model.forward, model.generate)
    original_forward, original_generate = model._specontext_original
    model.forward = torch.compile(original_forward, backend="specontext", options=options, dynamic=dynamic,
                                  **_isolated())

    @functools.wraps(original_generate)
    def generate(*args: Any, **kwargs: Any):
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
            input_ids = args[0] if args else kwargs.get("input_ids")
            kwargs["cache"] = make_cache(
                model, input_ids, kwargs.get("max_new_tokens"), kwargs.get("max_length"),
                config.selection.retrieval_head)
            if config.offload.device_memory_bytes is not None:  # KV offload (docs/offload.md)
                from .runtime.offload import enable_offload

                enable_offload(kwargs["cache"], model, config.offload.device_memory_bytes, config.buffer_tokens,
                               trace_path=config.offload.offload_trace,
                               resident_layers=config.selection.dense_layers)
        return original_generate(*args, **kwargs)

    model.generate = generate
    return model


def _isolated() -> dict[str, Any]:
    """``isolate_recompiles=True`` where torch has it (2.13+): each :func:`compile` keeps its
    own graphs, so recompiling one model with new options (a budget sweep) never counts
    against another compile's ``recompile_limit``, and old settings' graphs are never reused."""
    import inspect

    return {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`compile`: the model's own eager ``forward`` and ``generate`` again."""
    original = getattr(model, "_specontext_original", None)
    if original is not None:
        model.forward, model.generate = original
        del model._specontext_original
    if hasattr(model, "_specontext_options"):
        del model._specontext_options
    return model


def generation_compile_config(**options: Any):
    """A ``transformers.CompileConfig`` for ``generate(..., compile_config=...)``.

    Hugging Face compiles decode steps only on accelerators unless ``_compile_all_devices``
    is set, and only with a compileable cache: pass ``cache=SpeContextCache(...)`` (or
    :func:`make_cache`) to ``generate`` too. Prefill then runs eagerly (dense, exact).
    """
    from transformers import CompileConfig

    SpeContextConfig.from_options(options)
    # torch.compile refuses ``mode`` together with ``options``, so HF's default mode is unset
    config = CompileConfig(backend="specontext", mode=None, options=options or None)
    config._compile_all_devices = True
    return config
