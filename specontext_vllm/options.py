"""The plugin's options: the backend's names and validation, given through vLLM's configuration.

``LLM(..., additional_config={"specontext": {"budget": 1024}})`` or ``vllm serve ...
--additional-config '{"specontext": {"budget": 1024}}'``. The dict is validated by
:class:`specontext_compile.config.SpeContextConfig` (so a bad value raises the same error as
``torch.compile(..., options=...)`` would); without the ``"specontext"`` key the plugin leaves
vLLM's attention unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

from specontext_compile.config import SpeContextConfig, default_retrieval_layers, flatten_options
from specontext_compile.runtime.key_mirror import DEFAULT_SELECTION_KEYS

logger = logging.getLogger(__name__)

__all__ = ["KEY", "PluginOptions", "plugin_options"]

KEY = "specontext"  # the additional_config entry
_APPLIED = ("budget", "sink_tokens", "recent_window", "retrieval_layers", "page_rescue", "rescue_layers", "candidates",
            "dense_layers", "dense_below", "min_coverage", "selection_keys")
_NOT_BUILT = {"retrieval_head": None, "device_memory_bytes": None}


@dataclasses.dataclass(frozen=True)
class PluginOptions:
    """The options the plugin applies (the rest of :class:`SpeContextConfig` is validated, and
    those that would change the step are refused until built)."""

    budget: int
    sink_tokens: int
    recent_window: int
    retrieval_layers: tuple[int, ...] | None
    page_rescue: int = 0
    rescue_layers: tuple[int, ...] | None = None
    candidates: float = 1.0
    dense_layers: tuple[int, ...] = ()
    dense_below: int = 0
    min_coverage: float = 0.0
    selection_keys: str = DEFAULT_SELECTION_KEYS

    @property
    def int8_selection(self) -> bool:
        """Whether the selection scores the retrieval layers' int8 keys (:mod:`.int8_keys`)
        rather than vLLM's cache."""
        return self.selection_keys == "int8"

    def dense(self, layer: int, num_layers: int) -> bool:
        """Whether decoder layer ``layer`` keeps vLLM's dense attention for its decode rows
        (option ``dense_layers``; negative counts from the end)."""
        return bool(self.dense_layers) and layer in _named_layers("dense_layers", self.dense_layers, num_layers)

    def every_layer_dense(self, num_layers: int) -> bool:
        """Whether ``dense_layers`` names all ``num_layers`` layers (the step then makes no selection)."""
        return bool(self.dense_layers) and len(_named_layers("dense_layers", self.dense_layers, num_layers)) == num_layers

    def dense_rows(self, seq_lens):
        """Which decode rows attend densely on every layer (option ``dense_below``): a bool
        tensor ``[rows]``, True where the request's KV holds at most ``dense_below`` tokens
        (``seq_lens``: int ``[rows]``, tokens including this step's), or None when the option
        is off. The backend decides it from the store's capacity, once per compile; the plugin
        from each request's length, once per step."""
        # int64 and clamped: vLLM's lengths are int32, and torch wraps a larger Python int
        return None if self.dense_below <= 0 else seq_lens.long() <= min(self.dense_below, 2**62)

    def selected_tokens(self) -> int | None:
        """Tokens the step's shared selection keeps per row and KV head: ``ceil(candidates *
        budget)``, or None for every token (``candidates=inf``)."""
        tokens = self.candidates * self.budget  # inf also where a huge finite candidates overflows
        return None if math.isinf(tokens) else math.ceil(tokens)

    def refines(self, layer: int, num_layers: int) -> bool:
        """Whether decoder layer ``layer`` refines its candidates to ``budget`` tokens
        (:mod:`.refine`): every layer with ``candidates > 1``, a rescuing layer
        (:meth:`rescues`) always; never a dense layer (:meth:`dense`)."""
        return not self.dense(layer, num_layers) and (self.candidates > 1 or self.rescues(layer, num_layers))

    def retrieval_layers_for(self, num_layers: int) -> tuple[int, ...]:
        """The retrieval layers' indices among ``num_layers`` (negative counts from the end;
        None = :func:`~specontext_compile.config.default_retrieval_layers`)."""
        layers = self.retrieval_layers or default_retrieval_layers(num_layers)
        return _indices(layers, num_layers)

    def rescues(self, layer: int, num_layers: int) -> bool:
        """Whether decoder layer ``layer`` of ``num_layers`` adds rescued pages (:mod:`.rescue`):
        ``page_rescue > 0`` and the layer among ``rescue_layers`` (None = every layer), not a
        dense layer."""
        if self.page_rescue <= 0 or self.dense(layer, num_layers):
            return False
        return self.rescue_layers is None or layer in _named_layers("rescue_layers", self.rescue_layers, num_layers)


@functools.lru_cache(maxsize=None)
def _named_layers(option: str, layers: tuple[int, ...], num_layers: int) -> frozenset[int]:
    """The layers ``[0, num_layers)`` an option (``dense_layers``, ``rescue_layers``) names,
    negative ones counted from the end; a layer the model lacks names nothing, logged once as a
    warning (the backend's rule, ``passes.sparse_rewrite``)."""
    unknown = [j for j in layers if not -num_layers <= j < num_layers]
    if unknown:
        logger.warning("specontext: %s %s name no layer of this model (L = %d): they have no effect; use layers "
                       "in [-L, L)", option, unknown, num_layers)
    return frozenset(j + num_layers if j < 0 else j for j in layers if -num_layers <= j < num_layers)


def _indices(layers, num_layers: int) -> tuple[int, ...]:
    """Layer indices (negative counts from the end), clamped to ``num_layers``, sorted, unique."""
    return tuple(sorted({min(max(j + num_layers if j < 0 else j, 0), num_layers - 1) for j in layers}))


def plugin_options(vllm_config: Any) -> PluginOptions | None:
    """The validated options of ``vllm_config.additional_config["specontext"]``, or None.

    Raises:
        ValueError: an invalid option (the backend's message), or one whose part of the step
            the plugin does not build yet (named, with the value to use).
        TypeError: ``additional_config["specontext"]`` is not a dict.
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    given = extra.get(KEY) if isinstance(extra, dict) else None
    if given is None:
        return None
    if not isinstance(given, dict):
        raise TypeError(f"additional_config[{KEY!r}] must be a dict of specontext options, got {given!r}")
    given = flatten_options(given)  # grouped options are checked by their names too
    # the plugin's default is the shared selection alone (page_rescue=0): the refinement's cost
    # inside vLLM is measured in docs/vllm.md
    config = SpeContextConfig(**{"page_rescue": 0, **given})
    for name, value in _NOT_BUILT.items():
        if getattr(config, name) != value and name in given:
            raise ValueError(f"specontext option {name}={given[name]!r} is not built in the vLLM plugin yet; "
                             f"leave it out (the plugin runs {name}={value!r})")
    options = PluginOptions(**{name: getattr(config, name) for name in _APPLIED})
    if options.min_coverage > 0 and options.candidates <= 1 and options.rescue_layers == ():
        raise ValueError("specontext option 'min_coverage' needs a refinement to estimate from, and "
                         "rescue_layers=[] leaves no layer refining: set candidates=2 or name rescue_layers")
    return options
