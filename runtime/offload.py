"""Two-tier KV store: host tier, per-layer device buffers, elastic loading, adaptive plan.

SpeContext (arXiv 2512.00722) sections 5-6. :func:`enable_offload` attaches an
:class:`OffloadManager` to a :class:`~.kv_cache.SpeContextCache`; the decode graph's
``specontext::offload_*`` ops (:mod:`.offload_ops`, inserted by ``passes/schedule.py``) then
drive it once per step:

1. ``offload_plan`` (layer 0, before its write): before the step, while the length reaches
   ``ST[offloaded]`` (:class:`~.memory_model.MemoryModel`), offload one more layer, last
   layers first. Offloading a layer hands its full store to the host tier (on CUDA: a
   pinned host copy; on CPU the store already is host memory and the device tier is
   *emulated* by ``device_memory_bytes``) and gives it a device buffer of ``budget`` rows
   per (request, KV head) plus slot maps. Nothing is dropped: every token's K/V stays in
   the host store, which ``kv_write`` keeps appending to.
2. ``offload_prefetch(l)``: elastic loading on the side stream: the positions of
   ``S_now - loaded`` are copied from the host store into the slots of
   ``loaded - S_now``, in place (only tokens written before the step; the step's own
   tokens are copied by the attention op after the layer's ``kv_write``).
3. ``offload_rows(l)``: waits for that copy, then the rows the layer's refinement and
   attention read, from the device buffer through the slot map; the arithmetic on them is
   the resident layer's own code (:mod:`.offload_step`), so results are identical.

Layers still resident run the ordinary sparse attention, so one compiled graph serves every
plan as the output grows (no recompiles). Layers the option ``dense_layers`` keeps dense are
never offloaded (``resident_layers``): their attention reads the whole store every step, so
the store stays on the device and the memory model counts it there at every length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch

from . import page_bounds
from .elastic import copy_changed_rows, find_positions, plan_slots
from .memory_model import INF, DeviceMemoryError, MemoryModel
from .rollback import QUERY_SLOTS
from .sparse_attention import _gather_tokens
from .streams import CopyStream, CopyTicket
from .torch_private import counters, opaque_base, register_opaque_type
from .trace import TraceRecorder

logger = logging.getLogger(__name__)

__all__ = ["OffloadManager", "OffloadCopyError", "LayerBuffer", "check_device_memory", "enable_offload",
           "auto_device_bytes", "elastic_load", "free_device_bytes", "minimum_device_bytes", "model_weight_bytes",
           "resident_layer_indices"]

class OffloadCopyError(RuntimeError):
    """A prefetch copy failed; raised at the layer's wait."""


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (``M_O`` of the memory model)."""
    tensors = list(model.parameters()) + list(model.buffers())
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


AUTO = "auto"


def free_device_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now, bytes: ``torch.cuda.mem_get_info`` on CUDA; on CPU
    (where the device tier is emulated) the host's available physical memory.

    Raises:
        RuntimeError: when the platform does not report it (pass a number of bytes instead).
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError) as err:
        raise RuntimeError("device_memory_bytes='auto': this platform does not report free memory; "
                           "pass device_memory_bytes as a number of bytes") from err


def auto_device_bytes(device: torch.device, weight_bytes: int) -> int:
    """``device_memory_bytes="auto"``: the free memory plus the weights (the memory model
    counts them, and they are already on the device)."""
    total = free_device_bytes(device) + weight_bytes
    logger.info("specontext offload: device_memory_bytes='auto' -> %d bytes (%.1f MiB free + weights)",
                total, (total - weight_bytes) / 2**20)
    return total


def resident_layer_indices(layers, num_layers: int) -> tuple[int, ...]:
    """The layer indices ``[0, num_layers)`` that ``layers`` (an int or ints, option
    ``dense_layers``; negative counts from the end) names, sorted; indices the model lacks
    are left out (the rewrite pass logs them and keeps nothing dense for them).

    Raises:
        ValueError: when they name every layer (nothing could be offloaded).
    """
    layers = (layers,) if isinstance(layers, int) else tuple(layers or ())
    out = tuple(sorted({j + num_layers if j < 0 else j for j in layers} & set(range(num_layers))))
    if num_layers and len(out) == num_layers:
        raise ValueError(f"dense_layers keeps all {num_layers} layers dense, so KV offload has no layer to move "
                         "to the host tier; keep fewer layers dense or unset device_memory_bytes")
    return out


def _selection_bytes(batch: int, kv_heads: int, slots: int) -> int:
    """Bytes of one int64 ``[batch, kv_heads, slots]`` selection (or slot map)."""
    return batch * kv_heads * slots * 8


def page_bound_bytes(layers: int, batch: int, kv_heads: int, head_dim: int, elem_bytes: int, capacity: int,
                     page_tokens: int) -> int:
    """Device bytes of every layer's per-page key bounds (min and max, ``[batch, kv_heads,
    pages, head_dim]`` each; :mod:`.page_bounds`) for stores of ``capacity`` tokens: they stay
    on the device for offloaded layers too (the rescue scores pages there). 0 when
    ``page_tokens`` is 0 (no bounds)."""
    if not page_tokens:
        return 0
    return layers * 2 * batch * kv_heads * head_dim * elem_bytes * page_bounds.page_count(capacity, page_tokens)


def minimum_device_bytes(model: torch.nn.Module, budget: int, tokens: int = 0, batch: int = 1,
                         activation_factor: float = 0.3, page_tokens: int = page_bounds.PAGE_TOKENS,
                         capacity: int | None = None, resident_layers: int = 0) -> int:
    """The least ``device_memory_bytes`` with which ``model`` can decode ``tokens`` cached
    tokens of ``batch`` rows, every layer but ``resident_layers`` (option ``dense_layers``)
    offloaded (memory model, eq. 7 with ``L_cpu = L - resident_layers``; the resident
    layers hold their ``tokens`` rows): the weights x ``1 + activation_factor``, the retrieval state and the
    selection, one ``budget``-row buffer and slot map per offloadable layer, and every layer's page
    bounds for stores of ``capacity`` tokens (default ``tokens``; ``page_tokens``-token pages,
    the cache's, 0 = none; MLA stores keep none), from the model's config (heads, KV heads,
    head_dim, dtype) — what :class:`OffloadManager`'s model counts."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    param = next(model.parameters(), None)
    elem = param.element_size() if param is not None else 4
    state = QUERY_SLOTS * (batch * heads * head_dim * elem + 8)  # query_state + query_valid (rollback history)
    mm = MemoryModel(num_layers=config.num_hidden_layers, num_kv_heads=kv_heads, head_dim_k=head_dim,
                     head_dim_v=head_dim, elem_bytes=elem, batch=batch, budget=budget,
                     weight_bytes=model_weight_bytes(model), activation_factor=activation_factor,
                     fixed_bytes=state + _selection_bytes(batch, kv_heads, budget) + page_bound_bytes(
                         config.num_hidden_layers, batch, kv_heads, head_dim, elem,
                         tokens if capacity is None else capacity,
                         0 if getattr(config, "kv_lora_rank", None) else page_tokens),
                     map_bytes_per_layer=_selection_bytes(batch, kv_heads, budget),
                     resident_layers=resident_layers)
    return mm.minimum_device_bytes(tokens)


def check_device_memory(model: torch.nn.Module, device_memory_bytes: int, budget: int,
                        page_tokens: int = page_bounds.PAGE_TOKENS, capacity: int = 0,
                        resident_layers: int = 0) -> None:
    """Refuse a ``device_memory_bytes`` that cannot hold even an empty cache of one row
    with every offloadable layer offloaded (:func:`minimum_device_bytes`; ``page_tokens``: the cache's
    page-bound pages, 0 = none; ``capacity``: the stores' capacity in tokens when they
    exist, else 0: the page bounds of an empty cache, a lower bound; ``resident_layers``:
    layers kept on the device by ``dense_layers``, which need no buffer).

    Raises:
        DeviceMemoryError: naming the minimum (bytes and MiB) and the fix.
    """
    need = minimum_device_bytes(model, budget, page_tokens=page_tokens, capacity=capacity,
                                resident_layers=resident_layers)
    if device_memory_bytes < need:
        raise DeviceMemoryError(
            f"device_memory_bytes={device_memory_bytes} is too small for this model: its fixed part "
            f"alone (weights x1.3, one {budget}-row buffer per offloadable layer, page bounds) needs {need} bytes "
            f"({need / 2**20:.1f} MiB) before any token is cached; set device_memory_bytes >= {need} "
            "(plus the KV of the tokens you decode), lower budget, or leave it unset (no offload)")


@dataclasses.dataclass
class LayerBuffer:
    """Device buffer of one offloaded layer.

    Attributes:
        keys, values: ``[batch, num_kv_heads, budget, head_dim]`` rows on the device tier.
        pos_of_slot: int64 ``[batch, num_kv_heads, budget]``, the slot map: token position
            held by each slot, -1 = empty. Nothing kept on the device grows with the context;
            a lookup uses a transient inverse map sized by the store's capacity (:func:`~.elastic.find_positions`).
    """

    keys: torch.Tensor
    values: torch.Tensor
    pos_of_slot: torch.Tensor

    @classmethod
    def allocate(cls, store_k: torch.Tensor, store_v: torch.Tensor, budget: int,
                 device: torch.device) -> LayerBuffer:
        b, h, capacity, dk = store_k.shape
        slots = min(budget, capacity)
        return cls(
            keys=torch.zeros((b, h, slots, dk), dtype=store_k.dtype, device=device),
            values=torch.zeros((b, h, slots, store_v.shape[-1]), dtype=store_v.dtype, device=device),
            pos_of_slot=torch.full((b, h, slots), -1, dtype=torch.long, device=device),
        )

    def invalidate(self) -> None:
        """Forget every slot (the next load refills the whole selection)."""
        self.pos_of_slot.fill_(-1)

    def clear(self) -> None:
        """Forget every slot and zero the rows (a fresh buffer's contents)."""
        self.invalidate()
        self.keys.zero_()
        self.values.zero_()

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` (a request) becomes old row ``beam_idx[i]``: rows and slot map, in place."""
        idx = beam_idx.to(self.keys.device)
        for t in (self.keys, self.values, self.pos_of_slot):
            t.copy_(t.index_select(0, idx))

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep requests ``idx`` (int64, repeats allowed): rows and slot map, new tensors."""
        idx = idx.to(self.keys.device)
        self.keys = self.keys.index_select(0, idx)
        self.values = self.values.index_select(0, idx)
        self.pos_of_slot = self.pos_of_slot.index_select(0, idx)

    def drop_from(self, length: int) -> None:
        """Forget the slots holding positions ``>= length`` (a crop): they become empty and
        their rows zero, so a later token written at that position is loaded afresh."""
        dropped = self.pos_of_slot >= length
        self.pos_of_slot.masked_fill_(dropped, -1)
        self.keys.masked_fill_(dropped.unsqueeze(-1), 0)
        self.values.masked_fill_(dropped.unsqueeze(-1), 0)

    def grow(self, rows: int) -> None:
        """Hold ``rows`` slots per (request, KV head): empty slots appended (new tensors)."""
        extra = rows - self.pos_of_slot.shape[-1]
        if extra <= 0:
            return
        pad = (0, 0, 0, extra)
        self.keys = torch.nn.functional.pad(self.keys, pad)
        self.values = torch.nn.functional.pad(self.values, pad)
        self.pos_of_slot = torch.nn.functional.pad(self.pos_of_slot, (0, extra), value=-1)

    def slots_of(self, indices: torch.Tensor, capacity: int) -> torch.Tensor:
        """Slot of each position of ``indices`` ``[batch, kv, k]`` (positions of a store of
        ``capacity`` tokens); -1 = not loaded (or -1 padding)."""
        b, h, k = indices.shape
        table = self.pos_of_slot.view(b * h, -1)
        query = indices.to(table.device).reshape(b * h, k)
        found, at = find_positions(table, query, capacity)
        return torch.where(found & (query >= 0), at, -1).view(b, h, k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.pos_of_slot))


def elastic_load(buf: LayerBuffer, store_k: torch.Tensor, store_v: torch.Tensor,
                 indices: torch.Tensor, limit: int, loaded: torch.Tensor | None = None) -> int:
    """Bring the selected positions ``< limit`` into ``buf``, moving only what is missing.

    Slots whose position is not in ``indices`` (``S_prev - S_now``) are overwritten in place
    by the missing positions (``S_now - S_prev``), in slot order; slots still selected are
    kept. SpeContext section 5, elastic loading.

    Args:
        buf: the layer's device buffer and slot map (updated in place).
        store_k, store_v: the host tier ``[batch, num_kv_heads, capacity, head_dim]``.
        indices: int64 ``[batch, num_kv_heads, slots]`` selection, -1 = padding.
        limit: only positions ``< limit`` are loaded (tokens written before the call).
        loaded: bool ``[batch, num_kv_heads, slots]``, which positions the buffer holds, when
            the caller already looked them up (:meth:`LayerBuffer.slots_of` ``>= 0``).

    The slot plan and the row copy are :mod:`.elastic`'s fixed-size device program (the
    same code a captured CUDA step runs); only the returned count reads the device.

    Returns:
        rows moved (one row = one token's K and V of one (request, KV head)).

    Raises:
        RuntimeError: when a row needs more free slots than it has (selection larger than
            the buffer: an internal error; checked only when ``slots < k``).
    """
    b, h, k = indices.shape
    rows_n, slots = b * h, buf.pos_of_slot.shape[-1]
    idx = indices.to(buf.pos_of_slot.device).reshape(rows_n, k)
    pos_of_slot = buf.pos_of_slot.view(rows_n, slots)
    loaded = None if loaded is None else loaded.reshape(rows_n, k)
    new_pos, changed, overflow = plan_slots(pos_of_slot, idx, limit, store_k.shape[2], loaded)
    if k > slots and bool(overflow):  # impossible when k <= slots (a fact of shapes)
        raise RuntimeError("elastic_load: a selection row is larger than the device buffer")
    for buffer, store in ((buf.keys, store_k), (buf.values, store_v)):
        copy_changed_rows(buffer.view(rows_n, slots, -1), store.view(rows_n, store.shape[2], -1), new_pos, changed)
    pos_of_slot.copy_(new_pos)
    return int(changed.sum())


def _gather_rows(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``[batch, kv, k, dim]`` of ``buf`` ``[batch, kv, budget, dim]`` at ``slots``."""
    b, h, k = slots.shape
    n, dim = buf.shape[2], buf.shape[3]
    base = torch.arange(b * h, device=slots.device).view(b, h, 1) * n
    return buf.reshape(b * h * n, dim).index_select(0, (base + slots).reshape(-1)).view(b, h, k, dim)


@dataclasses.dataclass
class StepStats:
    """Transfer figures of one decode step (bytes = K and V rows moved host -> device)."""

    step: int
    length: int
    offloaded: int
    device_bytes: int
    bytes_elastic: int = 0
    bytes_full_reload: int = 0
    rescued_rows: int = 0  # rows the page rescue loaded on demand (included in bytes_elastic)
    q_len: int = 1  # tokens of the step (``length`` includes them)
    per_layer_rows: dict[int, int] = dataclasses.field(default_factory=dict)


class OffloadManager(opaque_base()):
    """Owns the host tier, device buffers, the copy stream and the adaptive plan of one cache.

    A torch opaque *reference* object (``torch._library.opaque_object``): the cache passes
    it to ``specontext::offload_plan`` at layer 0, so it is an explicit input of every
    traced graph, and the offload ops take it as their first argument (an op with an opaque
    argument has an ordered effect: no compiler pass reorders or drops it). There is no
    registry from store pointers to managers.

    Args:
        cache: the :class:`~.kv_cache.SpeContextCache` to manage.
        device_memory_bytes: size of the device tier (bytes; on CPU an emulated size), or
            ``"auto"``: the device's free memory plus the model's weights (already resident),
            read when the plan is made (:func:`auto_device_bytes`).
        budget: selected tokens per KV head (the buffer rows of an offloaded layer).
        weight_bytes: ``M_O``, the model's weights (see :func:`model_weight_bytes`). The plan's
            other terms (activation share, the draft head's own KV, extra buffers) are
            :class:`~.memory_model.MemoryModel`'s paper defaults.
        elastic: move only the selection's difference (True) or reload it every step.
        trace_path: when set, the Chrome trace of the latest finished decode step is written
            there at the start of every step (:mod:`.trace`).
        resident_layers: layers never offloaded (option ``dense_layers``: an int or ints,
            negative counts from the end; see :func:`resident_layer_indices`): their store
            stays on the device and the plan offloads the others, last layers first.
        inline_copies: run the copy jobs on the calling thread instead of the CPU worker
            (:class:`~.streams.CopyStream` ``inline``): a measurement knob, same results.

    Raises:
        ValueError: a bad ``device_memory_bytes``, a hybrid model, or ``resident_layers``
            naming every layer.
    """

    def __init__(self, cache, device_memory_bytes: int | str, budget: int, weight_bytes: int = 0, *,
                 elastic: bool = True, trace_path: str | Path | None = None, resident_layers=(),
                 inline_copies: bool = False):
        if device_memory_bytes != AUTO and (not isinstance(device_memory_bytes, int) or device_memory_bytes < 1):
            raise ValueError(f"device_memory_bytes must be an int >= 1 or {AUTO!r}, got {device_memory_bytes!r}")
        self.auto = device_memory_bytes == AUTO
        if len(getattr(cache, "kv_layer_indices", cache.layers)) != len(cache.layers):
            raise ValueError("KV offload of a hybrid model (layers without a KV cache) is not supported yet; "
                             "leave device_memory_bytes unset")
        self.cache = cache
        self.resident = resident_layer_indices(resident_layers, len(cache.layers))
        self.device_memory_bytes = device_memory_bytes
        self.budget = budget
        self.weight_bytes = weight_bytes
        self.elastic = elastic
        self.model: MemoryModel | None = None
        self.thresholds: list[float] | None = None
        self.buffers: dict[int, LayerBuffer] = {}
        self.offload_events: list[tuple[int, int]] = []  # (length, layer) in plan order
        self.stats: list[StepStats] = []
        self.fault_hook: Callable[[int], None] | None = None
        self.trace = TraceRecorder() if trace_path is not None else None
        self.trace_path = trace_path
        self.inline_copies = inline_copies
        self.closed = False
        self._stream: CopyStream | None = None
        self._tickets: dict[int, tuple[int, CopyTicket]] = {}
        self._next_ticket = 0
        self._step = -1
        self._step_start: dict[str, Any] | None = None
        self._failed: str | None = None
        self._last_attention_end: float | None = None
        self.selection: torch.Tensor | None = None

    def close(self) -> None:
        """Finish outstanding copies and stop the worker."""
        for _, ticket in list(self._tickets.values()):
            try:
                ticket.wait()
            except Exception:  # noqa: BLE001 - already reported at its wait
                pass
        self._tickets.clear()
        if self._stream is not None:
            self._stream.close()
        self.closed = True

    # --- plan -----------------------------------------------------------------------------
    @property
    def offloaded(self) -> list[int]:
        """Layers whose full store lives in the host tier (in offload order)."""
        return list(self.buffers)

    def prepare(self, device_memory_bytes: int | None = None) -> MemoryModel:
        """Build the memory model and solve the thresholds now (the stores must exist, i.e.
        after prefill); optionally with a new device-tier size. The first decode step does
        this on its own. Returns the model."""
        if device_memory_bytes is not None:
            self.device_memory_bytes = device_memory_bytes
        self._build_model()
        return self.model

    def _build_model(self) -> None:
        layer = self.cache.layers[0]
        if not layer.is_initialized:
            raise RuntimeError("the KV stores do not exist yet: run prefill before prepare()")
        check_offload_device(layer.keys.device)
        b, h, capacity, dk = layer.keys.shape
        slots = min(self.budget, capacity)
        if self.auto:
            self.device_memory_bytes = auto_device_bytes(layer.keys.device, self.weight_bytes)
        qs = self.cache.query_state
        fixed = qs.numel() * qs.element_size() if qs is not None else 0
        fixed += self.cache.query_valid.numel() * self.cache.query_valid.element_size()
        fixed += _selection_bytes(b, h, slots)  # the selection (int64) shared by every layer
        fixed += sum(t.numel() * t.element_size() for layer in self.cache.layers  # the page bounds
                     for t in (getattr(layer, "page_min", None), getattr(layer, "page_max", None)) if t is not None)
        self.model = MemoryModel(
            num_layers=len(self.cache.layers), num_kv_heads=h, head_dim_k=dk,
            head_dim_v=layer.values.shape[-1], elem_bytes=layer.keys.element_size(), batch=b,
            budget=slots, weight_bytes=self.weight_bytes, fixed_bytes=fixed,
            map_bytes_per_layer=_selection_bytes(b, h, slots), resident_layers=len(self.resident))
        self.thresholds = self.model.thresholds(self.device_memory_bytes)
        tokens = int(layer.cumulative_length)
        if tokens >= self.thresholds[-1]:  # not even every layer offloaded holds the prompt
            raise DeviceMemoryError(self.model.too_small_message(tokens))
        if self._stream is None:
            self._stream = CopyStream(layer.keys.device, inline=self.inline_copies)
        logger.info("specontext offload: %s", self.model.describe(self.device_memory_bytes))

    def offload_layer(self, layer_idx: int) -> None:
        """Hand layer ``layer_idx``'s store to the host tier and give it a device buffer."""
        layer = self.cache.layers[layer_idx]
        device = layer.keys.device
        if device.type == "cuda":  # real host tier: pinned memory; kv_write appends there
            layer.keys = layer.keys.to("cpu").pin_memory()
            layer.values = layer.values.to("cpu").pin_memory()
        self.buffers[layer_idx] = LayerBuffer.allocate(layer.keys, layer.values, self.budget, device)
        counters["specontext"]["offloaded_layers"] += 1

    def begin_step(self, query_state: torch.Tensor, query_valid: torch.Tensor, cached: int, q_len: int) -> None:
        """Start a decode step: run the adaptive plan for ``cached + q_len`` tokens and keep
        what :meth:`rollback` needs."""
        if self._failed is not None:
            raise OffloadCopyError(
                f"{self._failed}; call OffloadManager.rollback() (or cache.offload.rollback()) "
                "to undo the failed step before decoding on")
        if self.model is None:
            self._build_model()
        if self.trace is not None and self._step >= 0:
            self.trace.end_step(self._step)
            self.trace.write(self.trace_path)
        self._step += 1
        self.selection = None  # this step's selection [batch, kv_heads, budget], set by the first prefetch
        self._step_start = {
            "lengths": [int(layer.cumulative_length) for layer in self.cache.layers],
            "query_state": query_state.detach().clone(), "query_valid": query_valid.detach().clone(),
            "tensors": (query_state, query_valid),
        }
        total = cached + q_len
        before = len(self.buffers)
        target = self.model.plan(total, before, self.thresholds)
        free = [i for i in reversed(range(len(self.cache.layers)))
                if i not in self.buffers and i not in self.resident]
        for layer_idx in free[: target - before]:
            self.offload_layer(layer_idx)
            self.offload_events.append((total, layer_idx))
            logger.info("specontext offload: length %d >= ST[%d]=%s: layer %d -> host tier",
                        total, len(self.buffers) - 1, self.thresholds[len(self.buffers) - 1], layer_idx)
        self.stats.append(StepStats(self._step, total, len(self.buffers),
                                    self.model.device_bytes(total, len(self.buffers)), q_len=q_len))
        self._last_attention_end = self.trace.now_us() if self.trace else None

    def _row_bytes(self) -> int:
        layer = self.cache.layers[0]
        return (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()

    # --- prefetch / wait ------------------------------------------------------------------
    def _load_job(self, layer_idx: int, indices: torch.Tensor, limit: int) -> int:
        start = self.trace.now_us() if self.trace else 0.0
        if self.fault_hook is not None:
            self.fault_hook(layer_idx)
        layer, buf = self.cache.layers[layer_idx], self.buffers[layer_idx]
        if not self.elastic:
            buf.invalidate()
        rows = elastic_load(buf, layer.keys, layer.values, indices, limit)
        if self.trace:
            self.trace.add(f"copy L{layer_idx}", "copy", start, self.trace.now_us(),
                           rows=rows, bytes=rows * self._row_bytes())
        return rows

    def prefetch(self, layer_idx: int, indices: torch.Tensor, cached: int) -> int:
        """Start loading layer ``layer_idx``'s selected rows ``< cached``; returns a ticket
        id (-1 when the layer is resident: nothing to do)."""
        if indices.shape[-1] > self.budget:
            raise ValueError(
                f"specontext offload: the step prefetches {indices.shape[-1]} tokens per KV head but the "
                f"device buffers hold {self.budget}; with option candidates > 1 pass "
                f"budget=ceil(candidates * budget) to enable_offload (specontext_compile.compile does)")
        if self.selection is None:
            self.selection = indices
        if layer_idx not in self.buffers:
            return -1
        if self.stats:  # what reloading the whole selection would have moved
            self.stats[-1].bytes_full_reload += int((indices >= 0).sum()) * self._row_bytes()
        ticket = self._stream.submit(self._load_job, layer_idx, indices, cached)
        self._next_ticket += 1
        self._tickets[self._next_ticket] = (layer_idx, ticket)
        return self._next_ticket

    def wait(self, ticket_id: int, layer_idx: int) -> None:
        """Wait for a prefetch (a ticket already waited for, or -1, returns at once); on
        failure invalidate that buffer and raise :class:`OffloadCopyError` (the host tier is
        only read by copies: it stays intact)."""
        if ticket_id < 0 or ticket_id not in self._tickets:
            return
        _, ticket = self._tickets.pop(ticket_id)
        start = self.trace.now_us() if self.trace else 0.0
        try:
            rows = ticket.wait()
        except Exception as exc:
            self.buffers[layer_idx].invalidate()
            for other_layer, other in list(self._tickets.values()):  # drain this step's copies
                try:
                    other.wait()
                except Exception:  # noqa: BLE001
                    self.buffers[other_layer].invalidate()
            self._tickets.clear()
            self._failed = (f"prefetch of layer {layer_idx} failed at decode step {self._step} "
                            f"({type(exc).__name__}: {exc}); the host tier is intact, the layer's "
                            "device buffer was invalidated")
            counters["specontext"]["offload_copy_failures"] += 1
            raise OffloadCopyError(self._failed + "; call cache.offload.rollback() to undo the "
                                   "partial step, then repeat it") from exc
        finally:
            if self.trace:
                self.trace.add(f"wait L{layer_idx}", "wait", start, self.trace.now_us())
        self.stats[-1].per_layer_rows[layer_idx] = rows
        self.stats[-1].bytes_elastic += rows * self._row_bytes()

    def rollback(self) -> None:
        """Undo a step that failed part way: every layer's length and the retrieval state go
        back to the step's start, so the same step can be run again with the same result."""
        if self._step_start is None:
            return
        for layer, n in zip(self.cache.layers, self._step_start["lengths"]):
            layer.cumulative_length.fill_(n)
        qs, qv = self._step_start["tensors"]
        qs.copy_(self._step_start["query_state"])
        qv.copy_(self._step_start["query_valid"])
        if self.stats and self.stats[-1].step == self._step:
            self.stats.pop()
        self._step -= 1
        self._failed = None

    # --- Hugging Face cache operations (called by SpeContextCache, after its layers) -------
    def _drain(self) -> None:
        """Wait for copies still in flight (none between steps, unless a step was aborted)."""
        for layer_idx, ticket in list(self._tickets.values()):
            try:
                ticket.wait()
            except Exception:  # noqa: BLE001 - the buffer is refilled on its next load
                self.buffers[layer_idx].invalidate()
        self._tickets.clear()

    def before_cache_op(self, what: str) -> None:
        """Called before ``reorder_cache`` / ``crop`` / ``batch_*`` change the cache.

        Raises:
            OffloadCopyError: a failed step was not rolled back (its partial writes would
                be reordered or cropped with the rest); the message names the fix.
        """
        if self._failed is not None:
            raise OffloadCopyError(
                f"{what} on a cache whose offloaded step failed ({self._failed}); call "
                "cache.offload.rollback() first (or cache.reset() to start over)")
        self._drain()
        self._step_start = None  # a rollback snapshot does not survive a cache operation
        self.selection = None

    def on_reset(self) -> None:
        """``cache.reset()``: back to a fresh manager's state. Every layer is resident again
        (a CUDA host tier moves back to the layer's device), buffers, plan, offload events,
        step figures and any failure are forgotten; the memory model is rebuilt at the next
        decode step (the next prompt may have another batch size)."""
        self._drain()
        for layer_idx in list(self.buffers):
            layer = self.cache.layers[layer_idx]
            device = getattr(layer, "device", None)
            if layer.is_initialized and device is not None and layer.keys.device != torch.device(device):
                layer.keys = layer.keys.to(device)
                layer.values = layer.values.to(device)
        self.buffers.clear()
        self.offload_events.clear()
        self.stats.clear()
        self.model = None
        self.thresholds = None
        self._step = -1
        self._step_start = None
        self._failed = None
        self.selection = None
        self._last_attention_end = None

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search: each offloaded layer's buffer rows and slot map follow the new row
        order (the host tier is the layer's store, reordered by the layer)."""
        for buf in self.buffers.values():
            buf.reorder(beam_idx)

    def select_rows(self, idx: torch.Tensor) -> None:
        """Batch select / repeat: each buffer keeps rows ``idx``; the memory model (sized by
        the batch) is rebuilt at the next decode step."""
        for buf in self.buffers.values():
            buf.select_rows(idx)
        self.model = None
        self.thresholds = None

    def crop(self, length: int) -> None:
        """The cache now holds ``length`` tokens: every buffer forgets positions ``>= length``
        (the host tier, the layer's store, was cropped by the layer)."""
        for buf in self.buffers.values():
            buf.drop_from(length)

    # --- rows for the step's arithmetic ---------------------------------------------------
    def rows(self, layer_idx: int, key_cache: torch.Tensor, value_cache: torch.Tensor, positions: torch.Tensor,
             length: torch.Tensor, values: bool) -> list[torch.Tensor]:
        """The keys (and, with ``values``, the values) of ``positions`` ``[batch, kv, n]``
        (int64, ``-1`` padding) of layer ``layer_idx``, each ``[batch, kv, n, head_dim]``: what the resident step gathers from the store (``specontext::offload_rows``;
        the arithmetic on them is the resident layer's, :mod:`.offload_step`).

        A resident layer's rows are gathered from its store. An offloaded layer's come from its
        device buffer, never the host tier: the positions it lacks are loaded first (the step's
        own tokens, written after the prefetch started, and, with the page rescue, the rescued
        pages' tokens: counted in the step's ``rescued_rows``). A ``-1`` position reads some
        slot's row (attention gives it no weight).

        A buffer with no room for the positions (a manager sized for the candidates alone,
        used with the page rescue) grows, with a logged warning: the results stay those of
        the resident layer, the memory plan did not count the extra rows.

        Raises:
            RuntimeError: a position the buffer lacks after loading (an internal error)."""
        if layer_idx not in self.buffers:
            stores = (key_cache, value_cache) if values else (key_cache,)
            safe = positions.clamp(min=0)
            return [_gather_tokens(store, safe) for store in stores]
        capacity = key_cache.shape[2]
        buf, slots = self.buffers[layer_idx], self.buffers[layer_idx].slots_of(positions, capacity)
        if self._load_missing(layer_idx, key_cache, value_cache, positions, int(length), slots):
            slots = buf.slots_of(positions, capacity)  # the slot map changed
        if bool(((positions >= 0) & (slots < 0)).any()):
            raise RuntimeError(f"offloaded layer {layer_idx}: a selected token is not on the device tier "
                               "(prefetch/wait were not run for this layer)")
        slots = slots.clamp(min=0)
        if not values:  # a refinement (two-stage selection) reads keys only
            counters["specontext"]["offloaded_refine_calls"] += 1
            return [_gather_rows(buf.keys, slots)]
        counters["specontext"]["offloaded_attention_calls"] += 1  # (a fused site refines from the same read)
        self.mark_layer(layer_idx, True)
        return [_gather_rows(buf.keys, slots), _gather_rows(buf.values, slots)]

    def _load_missing(self, layer_idx: int, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      positions: torch.Tensor, length: int, slots: torch.Tensor) -> bool:
        """Load into layer ``layer_idx``'s buffer the positions ``< length`` it lacks (``slots``:
        their slots now, -1 = lacking; the buffer grows when they do not fit); rows counted in
        the step's stats, those written before the step (page rescue) also as
        ``rescued_rows``. Returns whether anything was loaded."""
        buf = self.buffers[layer_idx]
        lacking = (positions >= 0) & (positions < length) & (slots < 0)
        if not bool(lacking.any()):
            return False
        needed = int((positions >= 0).sum(-1).max())
        if needed > buf.pos_of_slot.shape[-1]:
            logger.warning("specontext offload: layer %d needs %d rows per KV head (candidates plus rescued pages) "
                           "but its device buffer was sized for %d; growing it (the memory plan did not count "
                           "them). Pass SpeContextConfig(...).buffer_tokens to enable_offload "
                           "(specontext_compile.compile does), or set page_rescue=0", layer_idx, needed,
                           buf.pos_of_slot.shape[-1])
            buf.grow(needed)
        step = self.stats[-1]
        rescued = int((lacking & (positions < step.length - step.q_len)).sum())
        with self._span(f"load L{layer_idx}", "copy"):
            moved = elastic_load(buf, key_cache, value_cache, positions, length, loaded=slots >= 0)
        step.rescued_rows += rescued
        step.per_layer_rows[layer_idx] = step.per_layer_rows.get(layer_idx, 0) + moved
        step.bytes_elastic += moved * self._row_bytes()
        return True

    def _span(self, name: str, cat: str):
        return self.trace.span(name, cat) if self.trace else contextlib.nullcontext()

    def mark_layer(self, layer_idx: int, offloaded: bool) -> None:
        """Trace the layer's compute span (from the previous attention's end to now)."""
        if self.trace is None:
            return
        now = self.trace.now_us()
        if self._last_attention_end is not None:
            self.trace.add(f"layer {layer_idx}", "compute", self._last_attention_end, now,
                           offloaded=offloaded)
        self._last_attention_end = now

    def summary(self) -> dict[str, Any]:
        """Thresholds, offload events and mean bytes moved per step (with/without elastic)."""
        steps = [s for s in self.stats if s.offloaded]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {
            "device_memory_bytes": self.device_memory_bytes,
            "thresholds": [None if t == INF else int(t) for t in (self.thresholds or [])],
            "resident_layers": list(self.resident),
            "offload_events": list(self.offload_events),
            "steps_with_offload": len(steps),
            "bytes_elastic_mean": mean([s.bytes_elastic for s in steps[1:]]),
            "bytes_full_reload_mean": mean([s.bytes_full_reload for s in steps[1:]]),
            "transfer_backend": self._stream.kind if self._stream else None,
        }


register_opaque_type(OffloadManager, typ="reference")  # an op argument type, like the ops themselves


def check_offload_device(device: torch.device) -> None:
    """Refuse KV offload where it is known not to work yet.

    Raises:
        NotImplementedError: on CUDA. When a layer's store moves to pinned host memory,
            dynamo re-traces the model and Hugging Face's attention code hands the host store
            to SDPA next to a device query, which fails before the rewrite pass runs (seen on
            an H200, docs/gpu.md). The CPU-emulated tiers (device "cpu") work and are tested.
    """
    if torch.device(device).type == "cuda":
        raise NotImplementedError(
            "specontext KV offload (device_memory_bytes) does not run on CUDA yet: the host "
            "tier breaks dynamo's re-trace (docs/gpu.md). Drop device_memory_bytes to keep the "
            "whole KV cache on the GPU, or run on CPU where the two tiers are emulated.")


def enable_offload(cache, model: torch.nn.Module | None, device_memory_bytes: int, budget: int,
                   **kwargs: Any) -> OffloadManager:
    """Attach an :class:`OffloadManager` to ``cache`` (as ``cache.offload``).

    Use with a graph compiled with the ``device_memory_bytes`` backend option (which inserts
    the prefetch/wait ops); ``specontext_compile.compile(model, device_memory_bytes=...)``
    does both. ``model`` gives ``M_O`` (its weights); ``kwargs`` go to
    :class:`OffloadManager`. With a graph compiled with option ``dense_layers``, pass
    ``resident_layers=SpeContextConfig(...).dense_layers`` (``sc.compile`` does): the manager
    does not read the compiled graph, and without it the plan may offload a dense layer (on
    CPU the text stays right, but the memory plan counts a buffer for a layer that reads its
    whole store).

    Raises:
        DeviceMemoryError: ``device_memory_bytes`` below :func:`minimum_device_bytes` (the
            fixed part alone does not fit), naming the minimum.
    """
    param = next(model.parameters(), None) if model is not None else None
    if param is not None:
        check_offload_device(param.device)
        if device_memory_bytes != AUTO:
            first = (getattr(cache, "kv_layers", None) or [None])[0]
            capacity = first.keys.shape[2] if getattr(first, "is_initialized", False) else 0
            resident = resident_layer_indices(kwargs.get("resident_layers", ()), len(cache.layers))
            check_device_memory(model, device_memory_bytes, budget,
                                getattr(first, "page_tokens", page_bounds.PAGE_TOKENS), capacity, len(resident))
    weight_bytes = model_weight_bytes(model) if model is not None else 0
    manager = OffloadManager(cache, device_memory_bytes, budget, weight_bytes, **kwargs)
    cache.offload = manager
    return manager
