"""The KV cache owned by the specontext runtime, usable as a Hugging Face ``Cache``.

Per decoder layer, keys and values live in preallocated stores
``[batch, num_key_value_heads, capacity, head_dim]`` written in place by the
``specontext::kv_write`` op at the layer's write position (an int64 tensor, so compiled
graphs never specialise on the length). In eager mode the store grows in chunks of
``chunk_tokens`` tokens (one copy per chunk, never a whole-cache ``torch.cat`` per step);
inside a compiled graph it cannot grow, so compiled decoding needs ``max_cache_len`` set
up front (``specontext_compile.compile`` does it from ``max_new_tokens``).

Run eagerly, the cache is dense and exact: ``update`` returns the whole store and Hugging
Face's mask (built for ``capacity`` positions, like its ``StaticCache``) hides unwritten
slots. The backend's pass rewrites the attention that reads the store into sparse attention.
The cache also carries the retrieval state (the retrieval layers' last query rows, one slot
per layer), which enters traced graphs through ``specontext::retrieval_anchor`` at layer 0.
Built with ``retrieval_head=DIR`` it also owns the draft head's key cache
(:class:`~specontext_compile.runtime.draft_retrieval.DraftKeyCache`, attribute ``draft``),
which enters traced graphs through ``specontext::draft_anchor`` right after that anchor.
"""

from __future__ import annotations

import logging
import math

import torch
from transformers.cache_utils import Cache, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from . import ops as _ops  # noqa: F401  (registers specontext::kv_write and the anchor)
from .draft_retrieval import DraftKeyCache, head_spec
from .protocol import STATS, DraftAnchor, RetrievalAnchor
from .retrieval import MAX_RETRIEVAL_LAYERS

logger = logging.getLogger(__name__)

__all__ = ["SpeContextCache", "SpeContextLayer"]

DEFAULT_CHUNK_TOKENS = 1024


def _static_address(*tensors: torch.Tensor) -> None:
    """Tell dynamo that these CUDA tensors keep their address from step to step (as Hugging
    Face's ``StaticCache`` does), so CUDA graphs (``mode="reduce-overhead"``) read and write
    them in place instead of copying them in and out; without a guard, so a new cache does
    not recompile (a moved address is re-recorded by CUDA graph trees)."""
    if is_torchdynamo_compiling():
        return
    for t in tensors:
        if t.is_cuda:
            torch._dynamo.mark_static_address(t, guard=False)


def _round_up(n: int, chunk: int) -> int:
    return max(chunk, math.ceil(n / chunk) * chunk)


class SpeContextLayer(StaticLayer):
    """One decoder layer's KV store (see the module docstring).

    Args:
        max_cache_len: capacity in tokens to allocate at the first write (rounded up to
            ``chunk_tokens``); ``None`` sizes it to the first write.
        chunk_tokens: growth step in tokens (eager mode only).
    """

    def __init__(self, max_cache_len: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        super().__init__(max_cache_len=max_cache_len or 0)
        self.chunk_tokens = chunk_tokens
        self.cumulative_length = torch.zeros((), dtype=torch.long)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate ``max_cache_len`` tokens, or the first write plus one chunk of headroom."""
        self.max_cache_len = self._initial_capacity(key_states.shape[-2])
        self.device = key_states.device
        b, h = key_states.shape[:2]
        self.keys = key_states.new_zeros((b, h, self.max_cache_len, key_states.shape[-1]))
        self.values = value_states.new_zeros((b, h, self.max_cache_len, value_states.shape[-1]))
        self.cumulative_length = self.cumulative_length.to(self.device)
        _static_address(self.keys, self.values, self.cumulative_length)
        self.is_initialized = True

    def _initial_capacity(self, first_write: int) -> int:
        if self.max_cache_len:  # sized by the caller: allocate exactly that
            return max(self.max_cache_len, first_write)
        return _round_up(first_write + self.chunk_tokens, self.chunk_tokens)

    def reserve(self, total_tokens: int) -> None:
        """Grow the store (eager only) so it holds ``total_tokens``; keeps written tokens."""
        if total_tokens <= self.max_cache_len:
            return
        new_len = _round_up(total_tokens, self.chunk_tokens)
        logger.debug("growing KV store %d -> %d tokens", self.max_cache_len, new_len)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], new_len, old.shape[-1]))
            new[:, :, : old.shape[2]].copy_(old)
            setattr(self, name, new)
        _static_address(self.keys, self.values)
        self.max_cache_len = new_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states``/``value_states`` ``[batch, num_kv_heads, q_len, head_dim]``
        and return the whole stores ``[batch, num_kv_heads, capacity, head_dim]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif not is_torchdynamo_compiling():
            self.reserve(int(self.cumulative_length) + key_states.shape[-2])
        torch.ops.specontext.kv_write(
            self.keys, self.values, self.cumulative_length, key_states, value_states
        )
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) for HF masks: the whole capacity, like ``StaticLayer``."""
        if self.is_initialized:
            return self.keys.shape[-2], 0
        return self._initial_capacity(query_length), 0

    def get_seq_length(self) -> torch.Tensor | int:
        """Tokens written (an int64 tensor once initialised, as in ``StaticLayer``)."""
        return self.cumulative_length if self.is_initialized else 0

    def reset(self) -> None:
        """Forget all tokens; the stores are kept and zeroed (unwritten slots hold zeros, so
        the dense-over-the-store shortcut never meets a stale non-finite value)."""
        self.cumulative_length.zero_()
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()


def _layer_windows(config) -> list[int]:
    """Per decoder layer: 0 = full causal attention, ``w`` = sliding window of ``w`` tokens,
    -1 = another kind (chunked, shared, ...) that the sparse rewrite leaves dense. Follows
    Hugging Face's own cache layout (``get_layer_types_and_kwargs``)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(config)
    except (ImportError, AttributeError, TypeError):  # older transformers / minimal configs
        window = getattr(config, "sliding_window", None)
        return [int(window) if window else 0] * config.num_hidden_layers
    windows = []
    for kind, extra in zip(types, kwargs):
        if kind == "full_attention":
            windows.append(0)
        elif kind == "sliding_attention" and extra.get("sliding_window"):
            windows.append(int(extra["sliding_window"]))
        else:
            windows.append(-1)
    return windows


class SpeContextCache(Cache):
    """Hugging Face cache backed by the specontext KV store.

    Args:
        config: the model's ``PretrainedConfig`` (``num_hidden_layers``,
            ``num_attention_heads``, ``head_dim`` or ``hidden_size`` are read).
        max_cache_len: tokens to preallocate per layer (prompt + new tokens); required for
            compiled decoding past the first chunk, see the module docstring.
        chunk_tokens: eager growth step in tokens (default 1024).
        retrieval_head: folder of a draft retrieval head (the backend option of the same
            name); the cache then keeps the head's key cache (``draft``). Must name the same
            folder as the backend's option, else the backend keeps attention dense.

    Raises:
        ValueError: on a non-positive ``max_cache_len`` or ``chunk_tokens``, or a bad
            ``retrieval_head`` (see
            :func:`~specontext_compile.runtime.draft_retrieval.head_spec`).
    """

    is_compileable = True

    def __init__(self, config, max_cache_len: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 retrieval_head: str | None = None):
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1 or None, got {max_cache_len}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layers = [SpeContextLayer(max_cache_len, chunk_tokens) for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.query_state: torch.Tensor | None = None
        self.query_valid = torch.zeros((MAX_RETRIEVAL_LAYERS,), dtype=torch.long)
        self.stats = torch.zeros((len(STATS),), dtype=torch.long)  # path counters, kept by the step
        self.layer_windows = _layer_windows(config)
        # a str attribute stays a graph constant (list ints become symbols under dynamic=True)
        self._layer_windows_text = ",".join(map(str, self.layer_windows))
        self.draft = DraftKeyCache(head_spec(retrieval_head)) if retrieval_head is not None else None

    def _init_retrieval_state(self, like: torch.Tensor) -> None:
        b = like.shape[0]
        self.query_state = like.new_zeros((MAX_RETRIEVAL_LAYERS, b, self.num_heads, 1, self.head_dim))
        self.query_valid = self.query_valid.to(like.device)
        self.stats = self.stats.to(like.device)
        _static_address(self.query_state, self.query_valid, self.stats)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """HF's cache update, plus the retrieval anchor at layer 0 (see module docstring)."""
        if layer_idx == 0:
            if self.query_state is None or self.query_state.shape[1] != key_states.shape[0]:
                self._init_retrieval_state(key_states)
            RetrievalAnchor(self.query_state, self.query_valid, self._layer_windows_text, self.stats).emit()
            if self.draft is not None:
                first = self.layers[0]
                capacity = (first.max_cache_len if first.is_initialized
                            else first._initial_capacity(key_states.shape[-2]))
                self.draft.prepare(key_states, capacity, is_torchdynamo_compiling())
                DraftAnchor(self.draft.keys, self.draft.length, self.draft.aux_state, self.draft.aux_valid,
                            self.draft.head).emit()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """HF mask sizes. In eager mode this is where the stores grow: the mask of a step is
        sized before its first write, so every layer grows here, before the step."""
        if not is_torchdynamo_compiling():
            for layer in self.layers:
                if layer.is_initialized:
                    layer.reserve(int(layer.cumulative_length) + query_length)
        return super().get_mask_sizes(query_length, layer_idx)

    def reset(self) -> None:
        """Forget all tokens and the retrieval state."""
        super().reset()
        self.query_valid.zero_()
        if self.draft is not None:
            self.draft.reset()

    def path_counts(self) -> dict[str, int]:
        """Path counters kept by the compiled decode step itself (names and meanings:
        :data:`~specontext_compile.runtime.protocol.STATS`), e.g. ``{"decode_steps": 20,
        "sparse_sites": 600, "gather_sites": 600, "dense_store_sites": 0}``; they count
        every step run through the backend, whatever compiled it (one host read here)."""
        return dict(zip(STATS, self.stats.tolist()))

    @property
    def kv_bytes(self) -> int:
        """Bytes held by the KV stores (allocated capacity, not only written tokens)."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if layer.is_initialized
            for t in (layer.keys, layer.values)
        )
