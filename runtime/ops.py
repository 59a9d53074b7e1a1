"""The runtime's custom operators (namespace ``specontext``), registered with torch.library.

Every op has a fake (meta) implementation so that dynamo and AOT tracing see it as one
opaque node, and declares the tensors it mutates so no compiler drops or reorders it.
The ops are registered when this module is imported (importing ``specontext_compile`` does),
which changes no other global state.

=====================  ====================================================================
op                     role
=====================  ====================================================================
kv_write               append this step's keys/values into a layer's preallocated KV store
retrieval_anchor       marks, in the traced graph, where the retrieval state enters (layer 0)
count_step             advances the cache's path counters once per decode step
check_capacity         (compiled CPU steps) raises before a write would pass the store's end
record_query           keeps layer ``j``'s last query row for the next step's selection
speculative_select     the selection node: runs once per step, before the first layer
sparse_attention       attention of one layer over the selected tokens only
draft_anchor           marks where the draft head's key cache enters (layer 0, ``retrieval_head``)
draft_step             the draft head's Q/K of the step's tokens; K into its own key cache
draft_record           keeps the last token's auxiliary hidden states (fused draft heads)
draft_select           the selection node when the draft head scores (``retrieval_head``)
=====================  ====================================================================
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch._dynamo.utils import counters

from . import aten_step, draft_retrieval
from .probe import active_probe, selection_recall
from .sparse_attention import mask_is_causal_only

logger = logging.getLogger(__name__)

__all__ = ["count_step", "draft_anchor", "draft_record", "draft_select", "draft_step", "kv_write", "record_query", "retrieval_anchor",
           "sparse_attention", "speculative_select"]

class CacheCapacityError(RuntimeError):
    """Raised when a write would pass the end of a preallocated KV store."""


@torch.library.custom_op("specontext::kv_write", mutates_args=("key_cache", "value_cache", "length"))
def kv_write(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    length: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[batch, num_kv_heads, q_len, head_dim]`` at positions
    ``length .. length+q_len-1`` of the caches ``[batch, num_kv_heads, capacity, head_dim]``
    and advance ``length`` (int64 scalar) by ``q_len``.

    Raises:
        CacheCapacityError: (CPU) when the write would pass ``capacity``; the cache is left
            untouched. Create the cache with a larger ``max_cache_len``.
    """
    if key_cache.device.type == "cpu":  # eager CPU only: the host is the device, no sync
        check_capacity(length, key_cache, key)
    aten_step.write_kv(key_cache, value_cache, length, key, value)


@kv_write.register_fake
def _(key_cache, value_cache, length, key, value) -> None:
    return None


@torch.library.custom_op("specontext::check_capacity", mutates_args=())
def check_capacity(length: torch.Tensor, key_cache: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Raise ``CacheCapacityError`` when writing ``key`` ``[batch, num_kv_heads, q_len,
    head_dim]`` at ``length`` would pass the end of ``key_cache`` (reads ``length`` on the
    host: CPU graphs only). Returns an int64 zero that the layer-0 write adds to its
    positions, so the check runs before any write of the step (see ``passes/lower.py``)."""
    start, q_len, capacity = int(length), key.shape[-2], key_cache.shape[-2]
    if start + q_len > capacity:
        raise CacheCapacityError(
            f"SpeContextCache is full: {start} + {q_len} tokens > capacity {capacity}. "
            "Create it with a larger max_cache_len (specontext_compile.compile sizes it "
            "from max_new_tokens).")
    return torch.zeros((), dtype=torch.long, device=length.device)


@check_capacity.register_fake
def _(length, key_cache, key):
    return length.new_empty(())


@torch.library.custom_op("specontext::retrieval_anchor", mutates_args=("query_state", "query_valid", "stats"))
def retrieval_anchor(
    query_state: torch.Tensor, query_valid: torch.Tensor, stats: torch.Tensor, layer_windows: str | None = None
) -> None:
    """No-op in eager mode. It puts the retrieval state tensors and the path counters
    ``stats`` into the traced graph at the start of layer 0, where the backend inserts the
    selection node. Arguments: :class:`~specontext_compile.runtime.protocol.RetrievalAnchor`
    (``layer_windows`` is a string so that it stays a graph constant even under
    ``dynamic=True``, where ints may become symbols)."""
    return


@retrieval_anchor.register_fake
def _(query_state, query_valid, stats, layer_windows=None) -> None:
    return None


@torch.library.custom_op("specontext::count_step", mutates_args=("stats",))
def count_step(stats: torch.Tensor, increments: list[int]) -> None:
    """Advance the path counters ``stats`` (int64, see
    :data:`~specontext_compile.runtime.protocol.STATS`) by ``increments`` (constants the
    pass computed from static shapes), once per decode step, on the device (no host sync)."""
    aten_step.count_step(stats, increments)


@count_step.register_fake
def _(stats, increments) -> None:
    return None


@torch.library.custom_op("specontext::record_query", mutates_args=("query_state", "query_valid"))
def record_query(query_state: torch.Tensor, query_valid: torch.Tensor, query: torch.Tensor, slot: int) -> None:
    """Keep the last query row of ``query`` ``[batch, num_heads, q_len, head_dim]`` in slot
    ``slot`` of ``query_state`` ``[slots, batch, num_heads, 1, head_dim]``; mark it valid
    in ``query_valid`` (int64 ``[slots]``)."""
    aten_step.record_query(query_state, query_valid, query, slot)


@record_query.register_fake
def _(query_state, query_valid, query, slot) -> None:
    return None


@torch.library.custom_op("specontext::speculative_select", mutates_args=())
def speculative_select(
    query_state: torch.Tensor,
    query_valid: torch.Tensor,
    key_caches: list[torch.Tensor],
    length: torch.Tensor,
    q_len: int,
    budget: int,
    sink: int,
    window: int,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """The speculative-selection node (SpeContext section 4), once per decode step (once per
    distinct sliding window when layers differ, e.g. Gemma's alternating layers).

    Args:
        query_state: ``[slots, batch, num_heads, 1, head_dim]``: slot ``i`` holds the query
            that retrieval layer ``i`` computed for the previous token.
        query_valid: int64 ``[slots]``, 0 until slot ``i`` was recorded; until every used
            slot is, the most recent tokens are selected instead.
        key_caches: the retrieval layers' key stores, each
            ``[batch, num_kv_heads, capacity, head_dim]``, in slot order.
        length: written tokens *before* this step (int64 scalar, the same for all layers).
        q_len: tokens in this step; budget, sink, window: see ``SpeContextConfig``.
        sliding_window: 0 = full attention; else select only inside the window of the
            step's rows (see :func:`~specontext_compile.runtime.selection.select_tokens`).

    Returns:
        int64 ``[batch, num_kv_heads, min(budget, capacity)]`` positions valid after this
        step's write (``-1`` = padding), shared by every layer of the step.
    """
    counters["specontext"]["selection_calls"] += 1
    return aten_step.speculative_select(query_state, query_valid, key_caches, length, q_len, budget, sink,
                                        window, scale, sliding_window)


@speculative_select.register_fake
def _(query_state, query_valid, key_caches, length, q_len, budget, sink, window, scale, sliding_window=0):
    key_cache = key_caches[0]
    slots = torch.sym_max(q_len, torch.sym_min(budget, key_cache.shape[-2]))
    return key_cache.new_empty((key_cache.shape[0], key_cache.shape[1], slots), dtype=torch.long)


@torch.library.custom_op("specontext::draft_anchor",
                         mutates_args=("draft_keys", "draft_length", "aux_state", "aux_valid"))
def draft_anchor(draft_keys: torch.Tensor, draft_length: torch.Tensor, aux_state: torch.Tensor,
                 aux_valid: torch.Tensor, head: str) -> None:
    """No-op in eager mode. Puts the draft head's state into the traced graph at the start
    of layer 0, right after ``retrieval_anchor``: its key cache (``draft_keys``
    ``[batch, head_kv_heads, capacity, head_dim]``, ``draft_length`` int64 scalar) and the
    recorded auxiliary hidden states (``aux_state`` ``[batch, 1, aux_width]``, ``aux_valid``
    int64 scalar). ``head`` is the head's resolved folder (a graph constant the pass checks
    against ``retrieval_head``)."""
    return


@draft_anchor.register_fake
def _(draft_keys, draft_length, aux_state, aux_valid, head) -> None:
    return None


@torch.library.custom_op("specontext::draft_step", mutates_args=("draft_keys", "draft_length"))
def draft_step(
    draft_keys: torch.Tensor,
    draft_length: torch.Tensor,
    length: torch.Tensor,
    input_ids: torch.Tensor,
    embedding: torch.Tensor,
    head: str,
    aux_state: torch.Tensor | None,
    aux_valid: torch.Tensor | None,
    hidden: list[torch.Tensor],
    after_write: bool,
) -> torch.Tensor:
    """The draft head on this step's tokens (SpeContext section 4).

    Runs :class:`~specontext_compile.runtime.eagle3.Eagle3RetrievalHead` (loaded from the
    folder ``head``, see :func:`~specontext_compile.runtime.draft_retrieval.load_head`) on
    ``input_ids`` (int64 ``[batch, q_len]``) at the cache positions ``start .. start+q_len-1``
    and writes its K into ``draft_keys`` ``[batch, head_kv_heads, capacity, head_dim]`` there.
    ``start`` is ``length`` (the target's layer-0 written tokens, int64 scalar), minus
    ``q_len`` when ``after_write`` (the op then runs after layer 0's ``kv_write``).
    ``draft_length`` advances to ``start + q_len`` only when it was ``start`` (every earlier
    position has its K); otherwise it stays behind and selections fall back to recency
    (never scored from unwritten slots). ``embedding``: the target's ``[vocab, hidden]``
    token embedding, used when the head has none.

    Auxiliary hidden states: none (``aux_state`` None) = zeros (embedding-only head). Fused:
    token ``i`` of the step gets the previous token's: ``aux_state`` ``[batch, 1,
    aux_width]`` for the first (zeros unless ``aux_valid``), and for the others the
    concatenation of ``hidden`` (this step's outputs ``[batch, q_len, target_hidden]`` of the
    auxiliary layers) at row ``i - 1``; steps of more than one token need ``hidden``.

    Returns:
        ``[batch, head_heads, 1, head_dim]`` (``draft_keys``' dtype): the head's query of the
        step's last token (prefill graphs ignore it).

    Raises:
        CacheCapacityError: (CPU) when the write would pass ``capacity``.
        ValueError: a fused step of several tokens without ``hidden``.
    """
    b, q_len = input_ids.shape
    capacity = draft_keys.shape[-2]
    device, dtype = draft_keys.device, draft_keys.dtype
    module = draft_retrieval.load_head(head, embedding, dtype, device)
    start = length.to(device) - (q_len if after_write else 0)
    positions = (start + torch.arange(q_len, device=device)).expand(b, q_len)
    width = module.fc.shape[1]
    if aux_state is None:
        aux = torch.zeros((b, q_len, width), dtype=dtype, device=device)
    else:
        prev = aux_state.to(dtype) * (aux_valid != 0).to(dtype)
        if q_len > 1:
            if not hidden:
                raise ValueError("a fused draft head needs this step's hidden states for a step of "
                                 f"{q_len} tokens")
            aux = torch.cat([prev, torch.cat(hidden, -1)[:, :-1].to(dtype)], 1)
        else:
            aux = prev
    query, key = module(input_ids.to(device), aux, positions)
    if device.type == "cpu":
        cached = int(start)
        if cached + q_len > capacity:
            raise CacheCapacityError(
                f"draft head key cache is full: {cached} + {q_len} tokens > capacity {capacity}. "
                "Create the SpeContextCache with a larger max_cache_len.")
        draft_keys[:, :, cached : cached + q_len].copy_(key)
    else:
        draft_keys.index_copy_(2, positions[0], key.to(dtype))
    in_step = (draft_length == start).to(draft_length.dtype)
    draft_length.copy_(in_step * (start + q_len) + (1 - in_step) * draft_length)
    return query[:, :, -1:, :].contiguous()


@draft_step.register_fake
def _(draft_keys, draft_length, length, input_ids, embedding, head, aux_state, aux_valid, hidden,
      after_write):
    spec = draft_retrieval.head_spec(head)
    return draft_keys.new_empty((input_ids.shape[0], spec.num_heads, 1, spec.head_dim))


@torch.library.custom_op("specontext::draft_record", mutates_args=("aux_state", "aux_valid"))
def draft_record(aux_state: torch.Tensor, aux_valid: torch.Tensor, hidden: list[torch.Tensor]) -> None:
    """Keep the last row of the concatenated ``hidden`` (the auxiliary layers' outputs
    ``[batch, q_len, target_hidden]``, in ``aux_layer_ids`` order) in ``aux_state``
    ``[batch, 1, aux_width]`` and set ``aux_valid`` (fused draft heads: the next step's first
    token reads it)."""
    aux_state.copy_(torch.cat([h[:, -1:] for h in hidden], -1))
    aux_valid.fill_(1)


@draft_record.register_fake
def _(aux_state, aux_valid, hidden) -> None:
    return None


@torch.library.custom_op("specontext::draft_select", mutates_args=())
def draft_select(
    query: torch.Tensor,
    draft_keys: torch.Tensor,
    draft_length: torch.Tensor,
    key_cache: torch.Tensor,
    length: torch.Tensor,
    q_len: int,
    budget: int,
    sink: int,
    window: int,
    sliding_window: int = 0,
) -> torch.Tensor:
    """The selection node with the draft head (``retrieval_head``), once per decode step
    (once per distinct sliding window).

    Args:
        query: ``[batch, head_heads, 1, head_dim]`` from ``draft_step`` of this step.
        draft_keys, draft_length: the head's key cache (see ``draft_step``); positions
            ``0 .. length+q_len-1`` are scored (causal: the step's last token attends to
            itself and every earlier token).
        key_cache: the target's layer-0 store ``[batch, num_kv_heads, capacity, head_dim]``
            (only its shape is read: KV heads and capacity).
        length: the target's written tokens before this step (int64 scalar).
        q_len, budget, sink, window, sliding_window: as ``speculative_select``.

    Returns:
        int64 ``[batch, num_kv_heads, min(budget, capacity)]`` ascending positions
        (``-1`` = padding): :func:`~specontext_compile.runtime.selection.select_tokens` of
        :func:`~specontext_compile.runtime.draft_retrieval.draft_scores`; the most recent
        tokens instead when the head's key cache misses a position (counter
        ``draft_recency_fallback``).
    """
    counters["specontext"]["draft_selection_calls"] += 1
    if key_cache.device.type == "cpu" and int(draft_length) < int(length) + q_len:  # eager CPU: no sync
        counters["specontext"]["draft_recency_fallback"] += 1
        if counters["specontext"]["draft_recency_fallback"] == 1:
            logger.warning("specontext: the draft head's key cache lacks positions (a step ran "
                           "without the backend, e.g. an eager prefill); selecting recent tokens")
    return aten_step.draft_select(query, draft_keys, draft_length, key_cache, length, q_len, budget, sink,
                                  window, sliding_window)


@draft_select.register_fake
def _(query, draft_keys, draft_length, key_cache, length, q_len, budget, sink, window, sliding_window=0):
    slots = torch.sym_max(q_len, torch.sym_min(budget, key_cache.shape[-2]))
    return key_cache.new_empty((key_cache.shape[0], key_cache.shape[1], slots), dtype=torch.long)


@torch.library.custom_op("specontext::sparse_attention", mutates_args=())
def sparse_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    indices: torch.Tensor,
    length: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    kernel: str = "torch",
    soft_cap: float | None = None,
    sliding_window: int = 0,
    dense_shortcut: bool = False,
) -> torch.Tensor:
    """Attention over the selected tokens; see
    :func:`~specontext_compile.runtime.sparse_attention.sparse_attention_reference` for shapes,
    ``soft_cap`` and ``sliding_window`` (those two always take the torch path).
    ``length`` counts this step's tokens (the op runs after the layer's ``kv_write``).
    ``kernel``: ``"torch"``, ``"triton"`` or ``"auto"`` (see ``SpeContextConfig.kernel``).
    ``dense_shortcut``: the caller promises that a selection with a slot for every store
    position holds every written position (true of the selection nodes' outputs); such a
    step (a static fact: budget >= capacity) then runs dense SDPA over the store instead of
    gathering (counter ``dense_prefix_calls``). The pass sets it unless the option
    ``dense_shortcut`` is off (tests use that to run the gather path at full budget).
    The torch path is :func:`~specontext_compile.runtime.aten_step.sparse_attention` (no host
    read); the Triton path on a masked step checks the mask once per step (one host sync)."""
    counters["specontext"]["sparse_attention_calls"] += 1
    probe = active_probe()
    if probe is not None:
        probe.values.append(
            selection_recall(query, key_cache, indices, int(length), scale, attn_mask)
        )
    plain = soft_cap is None and sliding_window == 0
    if plain and dense_shortcut and aten_step.covers_store(indices, key_cache):
        counters["specontext"]["dense_prefix_calls"] += 1
    elif plain and _use_triton(kernel, query) and _mask_allows_selection(attn_mask, indices, length, query.shape[2]):
        from ..codegen import sparse_decode_attention

        counters["specontext"]["triton_attention_calls"] += 1
        return sparse_decode_attention(
            query, key_cache, value_cache, indices, length, scale=scale, check_indices=False
        )
    else:
        counters["specontext"]["gather_attention_calls"] += 1
    return aten_step.sparse_attention(query, key_cache, value_cache, indices, length, attn_mask, scale,
                                      soft_cap, sliding_window, dense_shortcut)


class _MaskCheck:
    """The last decode-step answer of :func:`mask_is_causal_only` (weak references: a new
    step's mask or selection is a new object, so a stale answer is never reused)."""

    def __init__(self) -> None:
        self.mask = self.indices = None
        self.versions: tuple[int, int] | None = None
        self.ok = False

    def lookup(self, attn_mask: torch.Tensor, indices: torch.Tensor) -> bool | None:
        if self.mask is None or self.mask() is not attn_mask or self.indices() is not indices:
            return None
        return self.ok if self.versions == (attn_mask._version, indices._version) else None

    def store(self, attn_mask: torch.Tensor, indices: torch.Tensor, ok: bool) -> None:
        self.mask, self.indices = weakref.ref(attn_mask), weakref.ref(indices)
        self.versions, self.ok = (attn_mask._version, indices._version), ok


_MASK_CHECK = _MaskCheck()


def _mask_allows_selection(attn_mask, indices: torch.Tensor, length: torch.Tensor, q_len: int) -> bool:
    """:func:`mask_is_causal_only`, read back once per decode step instead of once per layer.

    Every layer of a step gets the same mask and selection objects, and at ``q_len == 1``
    the answer does not depend on the layer (selected positions are written positions, and
    all layers hold the same length), so the first layer's answer serves the others: one
    device sync per step on accelerators instead of one per layer."""
    if attn_mask is None:
        return True
    if q_len != 1:
        return mask_is_causal_only(attn_mask, indices, length, q_len)
    ok = _MASK_CHECK.lookup(attn_mask, indices)
    if ok is not None:
        counters["specontext"]["mask_check_reused"] += 1
        return ok
    ok = mask_is_causal_only(attn_mask, indices, length, q_len)
    _MASK_CHECK.store(attn_mask, indices, ok)
    return ok


def _use_triton(kernel: str, query: torch.Tensor) -> bool:
    """Whether to run the generated kernel (raises when ``"triton"`` cannot run here)."""
    if kernel == "torch":
        return False
    from ..codegen import interpreter_enabled, triton_available

    if kernel == "auto":
        return query.is_cuda and triton_available()
    if query.device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError(
            "specontext kernel='triton' on CPU tensors needs TRITON_INTERPRET=1 (Triton's "
            "interpreter); use kernel='torch' or 'auto' for real CPU runs"
        )
    return True


@sparse_attention.register_fake
def _(query, key_cache, value_cache, indices, length, attn_mask, scale, kernel="torch",
      soft_cap=None, sliding_window=0, dense_shortcut=False):
    b, h, q_len, _ = query.shape
    return query.new_empty((b, h, q_len, value_cache.shape[-1]))
