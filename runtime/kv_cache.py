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
from . import key_mirror
from .draft_retrieval import DraftKeyCache, head_spec
from .key_mirror import DEFAULT_SELECTION_KEYS, SELECTION_KEYS
from .page_bounds import PAGE_TOKENS, clear_pages_from, page_count, update_page_bounds
from .protocol import STATS, DraftAnchor, RetrievalAnchor
from .retrieval import picked_retrieval_layers
from .rollback import QUERY_SLOTS, crop_history
from .torch_private import mark_static_address

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
            mark_static_address(t)


def _round_up(n: int, chunk: int) -> int:
    return max(chunk, math.ceil(n / chunk) * chunk)


class SpeContextLayer(StaticLayer):
    """One decoder layer's KV store (see the module docstring).

    Args:
        max_cache_len: capacity in tokens to allocate at the first write (rounded up to
            ``chunk_tokens``); ``None`` sizes it to the first write.
        chunk_tokens: growth step in tokens (eager mode only).
        page_tokens: tokens per page of the per-page key bounds ``page_min``/``page_max``
            ``[batch, num_kv_heads, pages, head_dim]`` (:mod:`.page_bounds`, the page rescue
            reads them), kept up to date by every write; 0 = keep none.
        mirror_keys: keep the keys' int8 rows too (``key_levels`` ``[batch, num_kv_heads,
            capacity, head_dim]`` int8 and ``key_scales`` ``[batch, num_kv_heads, capacity]``
            float32, :mod:`.key_mirror`: what the selection reads with the option
            ``selection_keys="int8"``), kept up to date by every write.
    """

    def __init__(self, max_cache_len: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 page_tokens: int = PAGE_TOKENS, mirror_keys: bool = False):
        super().__init__(max_cache_len=max_cache_len or 0)
        self.chunk_tokens = chunk_tokens
        self.cumulative_length = torch.zeros((), dtype=torch.long)
        self.page_tokens = page_tokens
        self.page_min: torch.Tensor | None = None
        self.page_max: torch.Tensor | None = None
        # per-row page shift (int64 [batch], :func:`.page_bounds.row_shift`): the cache's, shared
        # by its layers (None on a layer used alone: pages start at position 0)
        self.page_shift: torch.Tensor | None = None
        self.mirror_keys = mirror_keys
        self.key_levels: torch.Tensor | None = None
        self.key_scales: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate ``max_cache_len`` tokens, or the first write plus one chunk of headroom."""
        self.max_cache_len = self._initial_capacity(key_states.shape[-2])
        self.device = key_states.device
        b, h = key_states.shape[:2]
        self.keys = key_states.new_zeros((b, h, self.max_cache_len, key_states.shape[-1]))
        self.values = value_states.new_zeros((b, h, self.max_cache_len, value_states.shape[-1]))
        self.cumulative_length = self.cumulative_length.to(self.device)
        self._allocate_page_bounds()
        self._allocate_mirror()
        _static_address(self.keys, self.values, self.cumulative_length)
        self.is_initialized = True

    def _allocate_mirror(self) -> None:
        """Zeroed int8 rows of the store (none unless ``mirror_keys``, and none for a store off
        the CPU: only the CPU selection kernel reads them)."""
        if self.mirror_keys and self.keys.device.type == "cpu":
            self.key_levels, self.key_scales = key_mirror.allocate(self.keys)
            _static_address(self.key_levels, self.key_scales)

    @property
    def _mirror(self) -> list[torch.Tensor]:
        """``[key_levels, key_scales]``, or ``[]`` (what ``kv_write`` takes)."""
        return [] if self.key_levels is None else [self.key_levels, self.key_scales]

    def _allocate_page_bounds(self) -> None:
        """Zeroed bounds for the store's pages (none when ``page_tokens`` is 0)."""
        if not self.page_tokens:
            return
        b, h, capacity, d = self.keys.shape
        self.page_min = self.keys.new_zeros((b, h, page_count(capacity, self.page_tokens), d))
        self.page_max = torch.zeros_like(self.page_min)
        _static_address(self.page_min, self.page_max)

    def _refresh_page_bounds(self, q_len: int) -> None:
        """Eager: recompute the bounds of the pages the last ``q_len`` written tokens touch."""
        if self.page_min is not None:
            update_page_bounds(self.keys, self.page_min, self.page_max, self.cumulative_length, q_len,
                               self.page_tokens, self.page_shift)

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
        if self.page_min is not None:  # written pages keep their bounds, new ones start at 0
            old_min, old_max = self.page_min, self.page_max
            self._allocate_page_bounds()
            self.page_min[:, :, : old_min.shape[2]].copy_(old_min)
            self.page_max[:, :, : old_max.shape[2]].copy_(old_max)
        if self.key_levels is not None:  # written rows keep their int8 copy
            old_levels, old_scales = self.key_levels, self.key_scales
            self._allocate_mirror()
            self.key_levels[:, :, : old_levels.shape[2]].copy_(old_levels)
            self.key_scales[:, :, : old_scales.shape[2]].copy_(old_scales)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states``/``value_states`` ``[batch, num_kv_heads, q_len, head_dim]``
        and return the whole stores ``[batch, num_kv_heads, capacity, head_dim]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.keys.shape[0]:  # static shapes: no host read
            raise ValueError(
                f"SpeContextCache holds {self.keys.shape[0]} rows, the step feeds {key_states.shape[0]}: "
                "a cache reused for a new prompt keeps its batch size; build a new SpeContextCache, or "
                "call cache.batch_select_indices / batch_repeat_interleave to the new batch size first")
        elif not is_torchdynamo_compiling():
            self.reserve(int(self.cumulative_length) + key_states.shape[-2])
        bounds = [] if self.page_min is None else [self.page_min, self.page_max]
        torch.ops.specontext.kv_write(self.keys, self.values, self.cumulative_length, key_states, value_states,
                                      bounds, self._mirror, self.page_shift if bounds else None,
                                      self.page_tokens if bounds else 0)
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
        for state in (self.page_min, self.page_max, self.key_levels, self.key_scales):
            if state is not None:
                state.zero_()

    # --- Hugging Face cache operations (table: runtime/README.md, "Cache operations") -------
    @property
    def batch_size(self) -> int:
        """Rows of the stores (HF's ``Cache.batch_size`` reads it); absent before the first
        write, like ``StaticLayer``'s attribute."""
        if not self.is_initialized:
            raise AttributeError("batch_size")
        return self.keys.shape[0]

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``i`` of the stores becomes old row ``beam_idx[i]``, in place (the
        stores keep their address, so CUDA graphs and the offload registry stay valid).

        Args:
            beam_idx: int64 ``[batch]``, a row index per row (repeats allowed).

        Raises:
            ValueError: ``beam_idx`` does not have one entry per row (use
                ``batch_select_indices`` to change the batch size).
        """
        if not self.is_initialized:
            return
        idx = _row_index(beam_idx, self.keys.shape[0], self.keys.device)
        for t in (self.keys, self.values, self.page_min, self.page_max, self.key_levels, self.key_scales):
            if t is not None:  # an offloaded layer's store is on the host, its bounds on the device
                t.copy_(t.index_select(0, idx.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (HF's convention: a negative count; 0 is
        a no-op). Their slots are zeroed (unwritten slots hold zeros) and the length goes back.

        Raises:
            ValueError: a positive count (pass ``-n`` to remove ``n`` tokens), or more tokens
                than the layer holds.
        """
        remove = _crop_count(tokens_to_remove)
        if remove == 0 or not self.is_initialized:
            return
        old = int(self.cumulative_length)
        if remove > old:
            raise ValueError(f"crop({tokens_to_remove}): the cache holds only {old} tokens")
        self.keys[:, :, old - remove: old].zero_()
        self.values[:, :, old - remove: old].zero_()
        self.cumulative_length.fill_(old - remove)
        if self.page_min is not None:  # pages past the new end are empty; the new last one lost tokens
            clear_pages_from(self.page_min, self.page_max, old - remove, self.page_tokens, self.page_shift)
            self._refresh_page_bounds(1)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (``[a, b]`` -> ``[a, a, b, b]``); new stores."""
        if not self.is_initialized:
            return
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.values = self.values.repeat_interleave(repeats, dim=0)
        _static_address(self.keys, self.values)
        if self.page_min is not None:
            self.page_min = self.page_min.repeat_interleave(repeats, dim=0)
            self.page_max = self.page_max.repeat_interleave(repeats, dim=0)
            _static_address(self.page_min, self.page_max)
        if self.key_levels is not None:
            self.key_levels = self.key_levels.repeat_interleave(repeats, dim=0)
            self.key_scales = self.key_scales.repeat_interleave(repeats, dim=0)
            _static_address(self.key_levels, self.key_scales)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (int indices or a bool mask over the rows); new stores."""
        if not self.is_initialized:
            return
        idx = _select_index(indices, self.keys.shape[0], self.keys.device)
        self.keys = self.keys.index_select(0, idx)
        self.values = self.values.index_select(0, idx)
        _static_address(self.keys, self.values)
        if self.page_min is not None:
            self.page_min = self.page_min.index_select(0, idx.to(self.page_min.device))
            self.page_max = self.page_max.index_select(0, idx.to(self.page_max.device))
            _static_address(self.page_min, self.page_max)
        if self.key_levels is not None:
            self.key_levels = self.key_levels.index_select(0, idx.to(self.key_levels.device))
            self.key_scales = self.key_scales.index_select(0, idx.to(self.key_scales.device))
            _static_address(self.key_levels, self.key_scales)


def _crop_count(tokens_to_remove: int) -> int:
    """Tokens to remove for HF's ``crop(tokens_to_remove)`` (negative = remove that many)."""
    n = int(tokens_to_remove)
    if n > 0:
        raise ValueError(
            f"crop({n}): SpeContextCache follows Hugging Face's static caches, where crop takes a "
            f"negative count of tokens to remove; call crop(-k) to drop the last k tokens "
            f"(to keep the first {n} tokens: crop({n} - cache.get_seq_length()))")
    return -n


def _row_index(beam_idx, batch: int, device) -> torch.Tensor:
    """``beam_idx`` as an int64 index of ``batch`` entries in ``[0, batch)`` on ``device``."""
    idx = torch.as_tensor(beam_idx, device=device).long().reshape(-1)
    if idx.numel() != batch:
        raise ValueError(
            f"reorder_cache: beam_idx has {idx.numel()} entries for a cache of {batch} rows; "
            "reorder_cache keeps the batch size (use batch_select_indices or "
            "batch_repeat_interleave to change it)")
    if batch and (int(idx.min()) < 0 or int(idx.max()) >= batch):
        raise ValueError(f"reorder_cache: beam_idx {idx.tolist()} out of range for {batch} rows")
    return idx


def _select_index(indices, batch: int, device) -> torch.Tensor:
    """``indices`` (ints, negative allowed, or a bool mask of ``batch`` rows) as int64 row
    indices on ``device``."""
    idx = torch.as_tensor(indices, device=device)
    if idx.dtype == torch.bool:
        if idx.numel() != batch:
            raise ValueError(f"batch_select_indices: a bool mask of {idx.numel()} entries for {batch} rows")
        return idx.reshape(-1).nonzero().reshape(-1)
    idx = idx.long().reshape(-1)
    if idx.numel() and (int(idx.min()) < -batch or int(idx.max()) >= batch):
        raise ValueError(f"batch_select_indices: indices {idx.tolist()} out of range for {batch} rows")
    return idx % max(batch, 1)


# Layer kinds (Hugging Face's ``layer_types``) whose state is not a KV store: they get Hugging
# Face's own cache layer class, exactly as its StaticCache builds them (hybrid models).
_NON_KV_KINDS = ("conv", "linear_attention", "dummy")
_HYBRID_KINDS = ("hybrid", "hybrid_sliding")
# layer kinds with a specontext KV store; any other kind (e.g. DeepSeek-V4's compressed
# attention, held only by the model's own cache class) is refused with the fix named
_KV_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention") + _HYBRID_KINDS


def _layer_kinds(config) -> tuple[list[str], list[dict]]:
    """Hugging Face's per-layer kinds and their kwargs (``get_layer_types_and_kwargs``);
    every layer ``full_attention`` (or ``sliding_attention``) on older transformers."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return get_layer_types_and_kwargs(config)
    except (ImportError, AttributeError, TypeError):  # older transformers / minimal configs
        window = getattr(config, "sliding_window", None)
        kind, extra = ("sliding_attention", {"sliding_window": window}) if window else ("full_attention", {})
        return [kind] * config.num_hidden_layers, [dict(extra) for _ in range(config.num_hidden_layers)]


def _layer_windows(config) -> list[int]:
    """Per layer *with a KV store* (in order): 0 = full causal attention, ``w`` = sliding
    window of ``w`` tokens, -1 = another kind (chunked, shared, ...) that the sparse rewrite
    leaves dense. Layers without a KV store (linear attention, convolution, shared-KV
    placeholders) have no entry: the i-th ``kv_write`` of a graph gets the i-th window."""
    windows = []
    for kind, extra in zip(*_layer_kinds(config)):
        if kind not in _KV_KINDS:
            continue
        if kind in ("full_attention", "hybrid", "indexed_attention"):  # DSA: its index mask is a mask
            windows.append(0)
        elif kind in ("sliding_attention", "hybrid_sliding") and extra.get("sliding_window"):
            windows.append(int(extra["sliding_window"]))
        else:
            windows.append(-1)
    return windows


def _make_layer(kind: str, extra: dict, max_cache_len: int | None, chunk_tokens: int):
    """A KV store for attention kinds; Hugging Face's own layer class (as its StaticCache
    uses) for layers without one; both for hybrid layers."""
    from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING

    if kind in _NON_KV_KINDS and kind in STATIC_LAYER_TYPE_MAPPING:
        kwargs = {k: v for k, v in extra.items() if k == "number_of_states"}
        return STATIC_LAYER_TYPE_MAPPING[kind](**kwargs)  # only conv / linear attention take kwargs
    if kind not in _KV_KINDS:
        raise ValueError(
            f"SpeContextCache: layer kind {kind!r} needs this model's own cache layer class (Hugging Face's "
            "StaticCache does not support it either); run the model with Hugging Face's DynamicCache "
            "(its attention then stays dense)")
    if kind in _HYBRID_KINDS:
        return SpeContextHybridLayer(max_cache_len, chunk_tokens, extra.get("number_of_states", 1))
    if kind == "indexed_attention":
        return SpeContextIndexedLayer(max_cache_len, chunk_tokens)
    return SpeContextLayer(max_cache_len, chunk_tokens)


try:
    from transformers.cache_utils import LinearAttentionLayer as _LinearAttentionLayer
except ImportError:  # pragma: no cover - older transformers: no hybrid layers
    _LinearAttentionLayer = None

if _LinearAttentionLayer is not None:
    class SpeContextHybridLayer(_LinearAttentionLayer, SpeContextLayer):
        """A hybrid layer (Hugging Face ``layer_types`` "hybrid"): its linear-attention state
        is Hugging Face's own (``LinearAttentionLayer``), its attention KV a specontext store."""

        def __init__(self, max_cache_len: int | None, chunk_tokens: int, number_of_states: int = 1):
            SpeContextLayer.__init__(self, max_cache_len, chunk_tokens)
            _LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

        def lazy_initialization(self, *args, **kwargs) -> None:
            if len(args) == 2 and not kwargs:  # the attention store (update)
                SpeContextLayer.lazy_initialization(self, *args)
            elif not args:  # the linear-attention states (update_conv_state / update_recurrent_state)
                _LinearAttentionLayer.lazy_initialization(self, **kwargs)

        def reset(self) -> None:
            _LinearAttentionLayer.reset(self)
            SpeContextLayer.reset(self)

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            _LinearAttentionLayer.reorder_cache(self, beam_idx)
            SpeContextLayer.reorder_cache(self, beam_idx)


class SpeContextIndexedLayer(SpeContextLayer):
    """A KV store plus the indexer key cache of Dynamic Sparse Attention models (Hugging Face
    layer kind "indexed_attention": DeepSeek-V3.2, GLM-MoE-DSA, ...), kept exactly as Hugging
    Face's ``StaticIndexedLayer`` keeps it (its own ``update_indexer`` runs on a buffer of
    this store's capacity), and grown, reordered, cropped and reset with the store."""

    def __init__(self, max_cache_len: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        super().__init__(max_cache_len, chunk_tokens)
        self.indexer = None  # a transformers StaticIndexedLayer, built at the first indexer write
        # positions some models keep on the layer, ``[position_dims, batch, seq]`` (Hugging
        # Face's attribute of the same name; reset, reordered and batch-selected with the rows)
        self.indexer_position_ids: torch.Tensor | None = None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """``[batch, q_len, index_head_dim]`` -> the whole indexer buffer ``[batch, capacity,
        index_head_dim]`` (Hugging Face's ``StaticIndexedLayer.update_indexer``)."""
        from transformers.cache_utils import StaticIndexedLayer

        if self.indexer is None:
            capacity = self.max_cache_len if self.is_initialized else self._initial_capacity(
                indexer_key_states.shape[1])
            self.indexer = StaticIndexedLayer(max_cache_len=capacity)
        elif not is_torchdynamo_compiling() and self.indexer.is_indexer_initialized:
            self._grow_indexer(int(self.indexer.indexer_cumulative_length) + indexer_key_states.shape[1])
        return self.indexer.update_indexer(indexer_key_states)

    def _grow_indexer(self, total_tokens: int) -> None:
        keys = self.indexer.indexer_keys
        if total_tokens <= keys.shape[1]:
            return
        new_len = max(_round_up(total_tokens, self.chunk_tokens), self.max_cache_len)
        grown = keys.new_zeros((keys.shape[0], new_len, keys.shape[2]))
        grown[:, : keys.shape[1]].copy_(keys)
        self.indexer.indexer_keys, self.indexer.max_cache_len = grown, new_len
        _static_address(grown)

    def _indexer_keys(self) -> torch.Tensor | None:
        return self.indexer.indexer_keys if self.indexer is not None and self.indexer.is_indexer_initialized else None

    def reset(self) -> None:
        super().reset()
        self.indexer_position_ids = None
        if self._indexer_keys() is not None:
            self.indexer.indexer_keys.zero_()
            self.indexer.indexer_cumulative_length.zero_()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        super().reorder_cache(beam_idx)
        keys = self._indexer_keys()
        if keys is not None:
            keys.copy_(keys.index_select(0, _row_index(beam_idx, keys.shape[0], keys.device)))
        if self.indexer_position_ids is not None:
            ids = self.indexer_position_ids
            self.indexer_position_ids = ids.index_select(1, _row_index(beam_idx, ids.shape[1], ids.device))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        keys, remove = self._indexer_keys(), _crop_count(tokens_to_remove)
        if keys is not None and remove:
            old = int(self.indexer.indexer_cumulative_length)
            keys[:, max(old - remove, 0): old].zero_()
            self.indexer.indexer_cumulative_length.fill_(max(old - remove, 0))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self._indexer_keys() is not None:
            self.indexer.indexer_keys = self.indexer.indexer_keys.repeat_interleave(repeats, dim=0)
        if self.indexer_position_ids is not None:
            self.indexer_position_ids = self.indexer_position_ids.repeat_interleave(repeats, dim=1)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        keys = self._indexer_keys()
        if keys is not None:
            self.indexer.indexer_keys = keys.index_select(0, _select_index(indices, keys.shape[0], keys.device))
        if self.indexer_position_ids is not None:
            ids = self.indexer_position_ids
            self.indexer_position_ids = ids.index_select(1, _select_index(indices, ids.shape[1], ids.device))


def _layer_config(config, layer: int):
    """The config of decoder layer ``layer``: Hugging Face's heterogeneous configs (Gemma 4,
    ...) refuse global reads of per-layer attributes and give one config per layer
    (``per_layer_config``); a homogeneous config is its own layer config."""
    per_layer = getattr(config, "per_layer_config", None)
    try:
        return per_layer[layer] if per_layer is not None else config
    except (IndexError, KeyError, TypeError):
        return config


def _latent_widths(config) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of a multi-head latent attention config, else None."""
    rank, rope = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    return (rank, rope) if isinstance(rank, int) and isinstance(rope, int) else None


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
        page_tokens: tokens per page of each store's per-page key bounds (what the option
            ``page_rescue`` reads; +2/page_tokens of the keys' bytes, not counted in
            :attr:`kv_bytes`; the offload memory model counts them); 0 = keep none. MLA stores keep none.
        selection_keys: ``"int8"`` (default) or ``"store"``: with ``"int8"`` the CPU stores of
            the retrieval layers (``retrieval_layers``, counted over the layers with a KV store as
            the option of that name is) also keep their keys' int8 rows (``key_levels``,
            ``key_scales``, :mod:`.key_mirror`; head_dim + 4 bytes per token and KV head, not
            counted in :attr:`kv_bytes`), which the selection scores with the backend's option
            ``selection_keys="int8"`` (its default too). MLA stores, stores on other devices and
            a cache with a ``retrieval_head`` keep none (only the CPU kernel of the lagged-query
            head reads them); ``"store"`` keeps none anywhere.
        retrieval_layers: the backend's option of that name (None: its default eight layers);
            read only with ``selection_keys="int8"``.

    Raises:
        ValueError: on a non-positive ``max_cache_len`` or ``chunk_tokens``, a negative
            ``page_tokens``, a ``selection_keys`` not in :data:`.key_mirror.SELECTION_KEYS`, or a bad
            ``retrieval_head`` (see
            :func:`~specontext_compile.runtime.draft_retrieval.head_spec`).
    """

    is_compileable = True

    def __init__(self, config, max_cache_len: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 retrieval_head: str | None = None, page_tokens: int = PAGE_TOKENS,
                 selection_keys: str = DEFAULT_SELECTION_KEYS,
                 retrieval_layers: tuple[int, ...] | int | None = None):
        if selection_keys not in SELECTION_KEYS:
            raise ValueError(f"selection_keys must be one of {SELECTION_KEYS} (what the selection scores: the "
                             f"stores' keys or their int8 rows), got {selection_keys!r}")
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1 or None, got {max_cache_len}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if not isinstance(page_tokens, int) or page_tokens < 0:
            raise ValueError(f"page_tokens must be an int >= 0 (0 = no page bounds), got {page_tokens!r}")
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layers = [_make_layer(kind, extra, max_cache_len, chunk_tokens) for kind, extra in zip(*_layer_kinds(config))]
        super().__init__(layers=layers)
        # the layers with a KV store (all of them, except in hybrid models)
        self.kv_layer_indices = [i for i, layer in enumerate(layers) if isinstance(layer, SpeContextLayer)]
        if not self.kv_layer_indices:
            raise ValueError("SpeContextCache: this model has no attention layer with a KV cache; use Hugging "
                             "Face's own cache (sparse attention has nothing to select from)")
        if retrieval_head is not None and len(self.kv_layer_indices) != len(layers):
            raise ValueError("SpeContextCache: retrieval_head with a hybrid model (layers without a KV cache) is "
                             "not supported yet; leave retrieval_head unset (the lagged-query head works)")
        # head counts of the first KV layer; the retrieval state is sized from its keys
        # (``_retrieval_heads``), so a tensor-parallel rank gets its own heads only
        first = _layer_config(config, self.kv_layer_indices[0])
        if not isinstance(getattr(first, "num_attention_heads", None), int):
            raise ValueError(f"SpeContextCache: {type(config).__name__} has no attention heads (a recurrent model: "
                             "nothing to select from); use Hugging Face's own cache")
        self.num_heads = first.num_attention_heads
        self.num_kv_heads = getattr(first, "num_key_value_heads", None)
        self.head_dim = getattr(first, "head_dim", None) or first.hidden_size // self.num_heads
        # multi-head latent attention (DeepSeek-V2/V3): the stores hold the latent and the
        # rotary key, and the recorded query is the absorbed one (runtime/mla.py)
        self.latent_widths = _latent_widths(first)
        for layer in self.kv_layers:  # latent rows are no keys: MLA stores keep no page bounds
            layer.page_tokens = 0 if self.latent_widths else page_tokens
        # the int8 rows serve the lagged-query head only: MLA and a draft head keep none
        self.selection_keys = "store" if self.latent_widths or retrieval_head is not None else selection_keys
        if self.selection_keys == "int8":  # the retrieval layers' stores keep their keys' int8 rows
            for i in picked_retrieval_layers(retrieval_layers, len(self.kv_layers)):
                self.kv_layers[i].mirror_keys = True
        self.query_state: torch.Tensor | None = None
        self.page_shift: torch.Tensor | None = None  # see _set_page_shift
        self.selection_state: torch.Tensor | None = None  # see _ensure_selection_state
        self.query_valid = torch.zeros((QUERY_SLOTS,), dtype=torch.long)  # current slots + rollback history
        self.stats = torch.zeros((len(STATS),), dtype=torch.long)  # path counters, kept by the step
        self.layer_windows = _layer_windows(config)
        # a str attribute stays a graph constant (list ints become symbols under dynamic=True)
        self._layer_windows_text = ",".join(map(str, self.layer_windows))
        self.draft = DraftKeyCache(head_spec(retrieval_head)) if retrieval_head is not None else None

    def _retrieval_heads(self, key_states: torch.Tensor) -> int:
        """Query heads this process computes, from the KV heads its layer-0 keys carry.

        Under head-sharded tensor parallelism (HF ``tp_plan``: q/k/v colwise) a rank holds
        ``num_key_value_heads / world`` KV heads and their whole query groups, so its query
        heads are ``num_attention_heads * local_kv / num_key_value_heads``; unsharded (or a
        config without a KV head count, e.g. multi-query Falcon) it is ``num_attention_heads``."""
        if self._is_latent(key_states):  # one latent row per token serves every query head
            return self.num_heads
        local_kv, total_kv = key_states.shape[1], self.num_kv_heads
        if total_kv and local_kv != total_kv and total_kv % local_kv == 0 and self.num_heads % total_kv == 0:
            return self.num_heads // total_kv * local_kv
        return self.num_heads

    def _is_latent(self, key_states: torch.Tensor) -> bool:
        """Whether ``key_states`` are an MLA layer's latent rows (one head, ``kv_lora_rank`` wide)."""
        return (self.latent_widths is not None and key_states.shape[1] == 1
                and key_states.shape[-1] == self.latent_widths[0])

    def _query_width(self, key_states: torch.Tensor) -> int:
        """Width of a recorded query: the keys' head size, or for MLA latent rows the absorbed
        query's ``kv_lora_rank + qk_rope_head_dim``."""
        return sum(self.latent_widths) if self._is_latent(key_states) else key_states.shape[-1]

    def _init_retrieval_state(self, like: torch.Tensor) -> None:
        """Allocate the retrieval state for ``like`` (layer 0's key states): one query row per
        retrieval layer, per local query head; the head size is the keys' (= the queries')."""
        b = like.shape[0]
        self.query_state = like.new_zeros(
            (QUERY_SLOTS, b, self._retrieval_heads(like), 1, self._query_width(like)))
        self.query_valid = self.query_valid.to(like.device)
        self.stats = self.stats.to(like.device)
        _static_address(self.query_state, self.query_valid, self.stats)
        self._set_page_shift(torch.zeros((b,), dtype=torch.long, device=like.device))

    def _set_page_shift(self, shift: torch.Tensor) -> None:
        """The per-row page shift (int64 ``[batch]``, set from the left padding at a prompt's
        first write by ``page_bounds.shift_from_mask``), shared by every store."""
        self.page_shift = shift
        _static_address(shift)
        for layer in self.kv_layers:
            layer.page_shift = shift

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """HF's cache update, plus the retrieval anchor at layer 0 (see module docstring)."""
        if layer_idx == self.kv_layer_indices[0]:  # the first layer with a KV store
            if self.query_state is None or self.query_state.shape[1] != key_states.shape[0] or (
                    self.query_state.shape[2] != self._retrieval_heads(key_states)
                    or self.query_state.shape[-1] != self._query_width(key_states)):
                self._init_retrieval_state(key_states)
            RetrievalAnchor(self.query_state, self.query_valid, self._layer_windows_text, self.stats,
                            self.selection_state, 0).emit()
            manager = self._offload_manager()
            if manager is not None:  # the offload manager enters the graph as an explicit input
                torch.ops.specontext.offload_plan(manager, self.query_state, self.query_valid,
                                                  self.kv_layers[0].cumulative_length, key_states.shape[-2],
                                                  len(self.layers))
            if self.draft is not None:
                first = self.kv_layers[0]
                capacity = (first.max_cache_len if first.is_initialized
                            else first._initial_capacity(key_states.shape[-2]))
                self.draft.prepare(key_states, capacity, is_torchdynamo_compiling())
                DraftAnchor(self.draft.keys, self.draft.length, self.draft.aux_state, self.draft.aux_valid,
                            self.draft.head).emit()
        elif is_torchdynamo_compiling() and self.query_state is not None and layer_idx in self.kv_layer_indices:
            # one anchor per KV layer: a graph that starts after a graph break still finds the
            # state (its first anchor), and reads the step's selection from selection_state
            RetrievalAnchor(self.query_state, self.query_valid, self._layer_windows_text, self.stats,
                            self.selection_state, self.kv_layer_indices.index(layer_idx)).emit()
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self.kv_layer_indices[0]:  # after the first write: the prefill allocates it
            self._ensure_selection_state(key_states)
        return out

    def _ensure_selection_state(self, key_states: torch.Tensor) -> None:
        """``selection_state`` ``[batch, kv_heads, capacity]`` int64 (-1 = none): a decode
        step's selection, kept by its first graph for the graphs after a graph break.
        Allocated once the first store exists (decode)."""
        first = self.layers[self.kv_layer_indices[0]]
        if not first.is_initialized:
            return
        shape = (key_states.shape[0], key_states.shape[1], first.max_cache_len)
        if self.selection_state is None or tuple(self.selection_state.shape) != shape:
            self.selection_state = torch.full(shape, -1, dtype=torch.long, device=key_states.device)
            _static_address(self.selection_state)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """HF mask sizes. In eager mode this is where the stores grow: the mask of a step is
        sized before its first write, so every layer grows here, before the step."""
        if not is_torchdynamo_compiling():
            for layer in self.kv_layers:
                if layer.is_initialized:
                    layer.reserve(int(layer.cumulative_length) + query_length)
        return super().get_mask_sizes(query_length, layer_idx)

    @property
    def kv_layers(self) -> list[SpeContextLayer]:
        """The layers with a KV store, in order (every layer, except in hybrid models)."""
        return [self.layers[i] for i in self.kv_layer_indices]

    # --- Hugging Face cache operations (table: runtime/README.md, "Cache operations") -------
    # Each applies to every piece of state the cache keeps: the KV stores (layers), the
    # retrieval state (query_state rows, query_valid), the path counters, the draft head's key
    # cache (``draft``) and the offload tier (``offload``, an OffloadManager, when attached).
    def _offload_manager(self):
        """The attached :class:`~.offload.OffloadManager` or None (``enable_offload`` sets the
        instance attribute ``offload``, which shadows HF's unused ``Cache.offload`` method)."""
        return self.__dict__.get("offload")

    def _rows(self) -> int | None:
        for layer in self.kv_layers:
            if layer.is_initialized:
                return layer.keys.shape[0]
        return None if self.query_state is None else self.query_state.shape[1]

    def reset(self) -> None:
        """Forget all tokens: the stores, the retrieval state, the path counters, the draft
        head's key cache and the offload tier's buffers and plan go back to a fresh cache's
        (buffers are kept and zeroed, so compiled graphs stay valid)."""
        manager = self._offload_manager()
        if manager is not None:
            manager.on_reset()
        super().reset()
        self.query_valid.zero_()
        if self.query_state is not None:
            self.query_state.zero_()
        if self.page_shift is not None:
            self.page_shift.zero_()
        self.stats.zero_()
        if self.draft is not None:
            self.draft.reset()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``i`` of every per-row state becomes old row ``beam_idx[i]`` (KV
        stores, ``query_state`` rows, the draft head's keys and recorded hidden states, the
        offload buffers and slot maps), in place. Per-slot / per-cache state (``query_valid``,
        lengths, path counters) is shared by the rows and unchanged.

        Args:
            beam_idx: int64 ``[batch]`` (repeats allowed).

        Raises:
            ValueError: not one entry per row, or an entry out of range.
            OffloadCopyError: a failed offloaded step was not rolled back first.
        """
        rows = self._rows()
        if rows is None:
            return
        manager = self._offload_manager()
        if manager is not None:
            manager.before_cache_op("reorder_cache")
        idx = _row_index(beam_idx, rows, self.query_state.device if self.query_state is not None
                         else self.kv_layers[0].keys.device)
        if self.page_shift is not None:  # before the stores: a crop-like refresh reads it
            self.page_shift.copy_(self.page_shift.index_select(0, idx.to(self.page_shift.device)))
        super().reorder_cache(idx)
        if self.query_state is not None:
            self.query_state.copy_(self.query_state.index_select(1, idx))
        if self.draft is not None:
            self.draft.reorder(idx)
        if manager is not None:
            manager.reorder(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in every per-row state (see
        :meth:`reorder_cache`); the per-row tensors are reallocated (a new batch size
        recompiles the compiled step once).

        Raises:
            ValueError: ``repeats < 1``.
            OffloadCopyError: a failed offloaded step was not rolled back first.
        """
        self._refuse_batch_change_if_hybrid("batch_repeat_interleave")
        if int(repeats) < 1:
            raise ValueError(f"batch_repeat_interleave: repeats must be >= 1, got {repeats}")
        rows = self._rows()
        if rows is None:
            return
        idx = torch.arange(rows).repeat_interleave(int(repeats))
        self._select_rows(idx, "batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (int indices or a bool mask over the rows) of every
        per-row state (see :meth:`reorder_cache`); the per-row tensors are reallocated.

        Raises:
            ValueError: an index out of range, or a mask of the wrong size.
            OffloadCopyError: a failed offloaded step was not rolled back first.
        """
        self._refuse_batch_change_if_hybrid("batch_select_indices")
        rows = self._rows()
        if rows is None:
            return
        self._select_rows(_select_index(indices, rows, "cpu"), "batch_select_indices")

    def _refuse_batch_change_if_hybrid(self, what: str) -> None:
        if len(self.kv_layer_indices) != len(self.layers):
            raise ValueError(f"{what}: not supported for hybrid models (Hugging Face's linear-attention cache "
                             "layers cannot change their batch either); build a new cache for the new batch")

    def _select_rows(self, idx: torch.Tensor, what: str) -> None:
        manager = self._offload_manager()
        if manager is not None:
            manager.before_cache_op(what)
        if self.page_shift is not None:
            self._set_page_shift(self.page_shift.index_select(0, idx.to(self.page_shift.device)))
        for layer in self.layers:
            if layer.is_initialized:
                layer.batch_select_indices(idx)
        if self.query_state is not None:
            self.query_state = self.query_state.index_select(1, idx.to(self.query_state.device))
            _static_address(self.query_state)
        if self.draft is not None:
            self.draft.select_rows(idx)
        if manager is not None:
            manager.select_rows(idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (HF's convention; 0 is a no-op): every
        layer's length goes back and the dropped slots are zeroed; the draft head's length
        goes back too (``min(length, new length)``) and the offload buffers forget the dropped
        positions. The recorded query (lagged-query head) belongs to the last *dropped*
        token: it is marked stale and the history entries of dropped positions are forgotten,
        so the next step restores the last *kept* token's query from the history
        (``runtime/rollback.py``; a crop deeper than ``ROLLBACK_TOKENS`` selects by recency)
        and selects exactly as a fresh cache fed the kept tokens. A fused draft head keeps
        the recorded hidden states of its kept positions, so its next key reads the last kept
        token's, as a fresh cache's would (:meth:`.draft_retrieval.DraftKeyCache.crop`).
        Path counters count steps run: unchanged.

        Raises:
            ValueError: a positive count (pass ``-n``), or more tokens than the cache holds.
            OffloadCopyError: a failed offloaded step was not rolled back first.
        """
        remove = _crop_count(tokens_to_remove)
        if remove == 0:
            return
        old = int(self.kv_layers[0].get_seq_length())
        if remove > old:
            raise ValueError(f"crop({tokens_to_remove}): the cache holds only {old} tokens")
        manager = self._offload_manager()
        if manager is not None:
            manager.before_cache_op("crop")
        super().crop(tokens_to_remove)
        new = old - remove
        crop_history(self.query_valid, new)  # the next step restores the kept token's query (rollback.py)
        if self.draft is not None:
            self.draft.crop(new)
        if manager is not None:
            manager.crop(new)
        logger.debug("specontext cache: cropped %d -> %d tokens", old, new)

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
            for layer in self.kv_layers
            if layer.is_initialized
            for t in (layer.keys, layer.values)
        )
