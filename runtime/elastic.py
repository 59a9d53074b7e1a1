"""Elastic loading as a fixed-size device program (SpeContext section 5, "elastic loading").

An offloaded layer keeps ``slots`` rows of its KV cache on the device (``LayerBuffer``,
:mod:`.offload`): the tokens of the previous step's selection. Each step only the tokens the
new selection adds (``S_now - S_prev``) move from the host tier, into the slots of tokens it
dropped (``S_prev - S_now``). This module computes that move with tensors of fixed shape and
no host read, so the same code can run inside a compiled step or a captured CUDA graph:

* :func:`plan_slots` — which position each slot holds after the load, and which slots
  change. The k-th missing position of a row (in selection order) goes to the row's k-th
  free slot (in slot order); slots still selected keep their token.
* :func:`copy_changed_rows` — moves the changed slots' K and V rows from the host tier:
  by index on CPU (host and device are one memory there), and on CUDA by a Triton kernel
  that reads only the changed rows (``copy_rows_kernel``; the store may be pinned host
  memory, which the GPU reads through unified addressing).

Invariants: a row's selection holds unique positions ``>= 0`` or ``-1`` padding; a buffer
of ``slots >= k`` rows always has room for a selection of ``k`` positions (the positions
it keeps are selected ones, so ``kept + missing <= k``), which is a fact of shapes, checked
without reading the device.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["find_positions", "plan_slots", "copy_changed_rows", "copy_rows_reference"]


def find_positions(table: torch.Tensor, query: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, where ``query`` ``[rows, q]`` positions occur in ``table`` ``[rows, n]`` (unique
    positions ``>= 0`` per row, all below ``capacity``; negative entries are empty).

    Returns ``(found, at)``: bool ``[rows, q]`` and the index into ``table`` (valid where
    found; a negative query is never found). A transient inverse map ``[rows, capacity + 1]``
    (int64) answers by one scatter and one gather (sort + binary search, nothing sized by the
    store, was several times slower on CPU at 3K-row buffers: docs/offload.md). No host read."""
    rows, n = table.shape
    inverse = torch.full((rows, capacity + 1), -1, dtype=torch.long, device=table.device)
    slot = torch.arange(n, device=table.device).expand(rows, n)
    inverse.scatter_(1, torch.where(table >= 0, table, capacity), slot)
    inverse[:, capacity] = -1  # the column every empty entry and every negative query maps to
    at = inverse.gather(1, torch.where((query >= 0) & (query < capacity), query, capacity))
    return at >= 0, at.clamp(min=0)


def plan_slots(pos_of_slot: torch.Tensor, indices: torch.Tensor, limit: torch.Tensor | int, capacity: int,
               loaded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the missing selected positions go in a layer's device buffer.

    Args:
        pos_of_slot: int64 ``[rows, slots]``, the position each slot holds (-1 = empty);
            rows are (request, KV head) pairs.
        indices: int64 ``[rows, k]``, the selection (unique positions, -1 = padding).
        limit: only positions ``< limit`` are loaded (tokens written before the load); an
            int or an int64 0-d tensor (on the device: no host read).
        capacity: the store's positions (a bound for :func:`find_positions`).
        loaded: bool ``[rows, k]``, which selected positions the buffer already holds, when
            the caller looked them up.

    Returns:
        ``(new_pos_of_slot, changed, overflow)``: int64 ``[rows, slots]`` the slot map after
        the load; bool ``[rows, slots]`` the slots whose row must be copied from the host
        tier; a bool 0-d tensor, True when some row has more missing positions than free
        slots (only possible when ``k > slots``; those positions are then not placed).
    """
    rows, k = indices.shape
    if k == 0:  # an empty selection moves nothing
        none = torch.zeros_like(pos_of_slot, dtype=torch.bool)
        return pos_of_slot.clone(), none, none.any()
    loaded = find_positions(pos_of_slot, indices, capacity)[0] if loaded is None else loaded
    # a tensor limit stays on the device; an int is compared as a Python scalar (making a
    # device tensor of it would copy from the host, a sync on CUDA)
    limit = limit.to(indices.device) if isinstance(limit, torch.Tensor) else int(limit)
    need = (indices >= 0) & (indices < limit) & ~loaded
    n_need = need.sum(1, keepdim=True)
    keep = (pos_of_slot >= 0) & find_positions(indices, pos_of_slot, capacity)[0]
    free = ~keep
    free_rank = free.cumsum(1) - 1  # a free slot's rank among its row's free slots, in slot order
    # the missing positions first, in selection order (a stable sort of the "not needed" flag)
    missing = indices.gather(1, torch.argsort((~need).to(torch.int8), dim=1, stable=True))
    changed = free & (free_rank < n_need)
    new_pos = torch.where(changed, missing.gather(1, free_rank.clamp(0, k - 1)), pos_of_slot)
    overflow = (n_need.squeeze(1) > free.sum(1)).any()
    return new_pos, changed, overflow


def copy_rows_reference(buffer: torch.Tensor, store: torch.Tensor, new_pos: torch.Tensor,
                        changed: torch.Tensor) -> None:
    """``buffer[r, s] = store[r, new_pos[r, s]]`` where ``changed[r, s]``, by index (CPU: the
    rows to move are found on the host, which is the device there).

    Shapes: ``buffer`` ``[rows, slots, dim]``, ``store`` ``[rows, capacity, dim]``,
    ``new_pos`` int64 and ``changed`` bool ``[rows, slots]``."""
    rr, ss = changed.nonzero(as_tuple=True)
    rows = store[rr.to(store.device), new_pos[rr, ss].to(store.device)]
    buffer[rr, ss] = rows.to(buffer.device, non_blocking=store.device.type == "cpu")


def copy_changed_rows(buffer: torch.Tensor, store: torch.Tensor, new_pos: torch.Tensor,
                      changed: torch.Tensor, *, kernel: bool | None = None) -> None:
    """Copy the changed slots' rows of one tier (keys or values) into ``buffer``.

    Args:
        buffer: ``[rows, slots, dim]`` device rows (a view of ``LayerBuffer.keys`` or ``values``).
        store: ``[rows, capacity, dim]`` the host tier (on CUDA: pinned host memory or device).
        new_pos, changed: :func:`plan_slots`'s ``[rows, slots]`` results.
        kernel: use the Triton kernel (default: a CUDA ``buffer`` and a store the GPU can
            address, on the device or pinned host memory, laid out as the kernel reads; any
            other pair is copied by index). On CPU tensors it runs under
            ``TRITON_INTERPRET=1`` only (tests).

    Raises:
        ValueError: ``kernel`` with a buffer that is not contiguous or a store whose token
            rows are not ``dim`` contiguous elements (the indexed copy takes any layout).
    """
    if kernel is None:
        kernel = buffer.is_cuda and (store.is_cuda or store.is_pinned()) and _kernel_layout(buffer, store)
    if not kernel:
        copy_rows_reference(buffer, store, new_pos, changed)
        return
    _launch_copy(buffer, store, new_pos, changed)


def _launch_copy(buffer: torch.Tensor, store: torch.Tensor, new_pos: torch.Tensor, changed: torch.Tensor) -> None:
    rows, slots, dim = buffer.shape
    if not _kernel_layout(buffer, store):
        raise ValueError(f"copy_changed_rows' kernel needs a contiguous buffer and store rows [capacity, dim] "
                         f"contiguous (buffer strides {tuple(buffer.stride())}, store {tuple(store.stride())}); "
                         "pass kernel=False to copy by index")
    load = torch.where(changed, new_pos, -1).contiguous()  # the position each slot loads, -1 = none
    block_s = 16
    block_d = max(16, 1 << (dim - 1).bit_length())
    _copy_kernel()[(rows, (slots + block_s - 1) // block_s)](
        buffer, store, load, store.stride(0), slots, dim, BLOCK_S=block_s, BLOCK_D=block_d)


def _kernel_layout(buffer: torch.Tensor, store: torch.Tensor) -> bool:
    """Whether the kernel can read these tensors: a contiguous buffer, and store token rows of
    ``dim`` contiguous elements (any distance between the store's rows)."""
    return buffer.is_contiguous() and store.stride(2) == 1 and store.stride(1) == buffer.shape[2]


@functools.cache
def _copy_kernel():
    """The Triton kernel, built on first use (triton is imported only then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows_kernel(buf_ptr, store_ptr, load_ptr, store_row_stride, slots, dim,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        """One program per (row, block of slots): each slot with a position to load
        (``load >= 0``) gets that token's row from the store; the others read nothing (so
        only the difference crosses the bus when the store is host memory). The buffer
        ``[rows, slots, dim]`` and the load map ``[rows, slots]`` are contiguous; a store row
        ``[capacity, dim]`` is contiguous, rows ``store_row_stride`` elements apart."""
        row = tl.program_id(0).to(tl.int64)
        offs_s = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        pos = tl.load(load_ptr + row * slots + offs_s, mask=offs_s < slots, other=-1).to(tl.int64)
        mask = (pos >= 0)[:, None] & (offs_d < dim)[None, :]
        src = store_ptr + row * store_row_stride + pos[:, None] * dim + offs_d[None, :]
        dst = buf_ptr + (row * slots + offs_s[:, None]) * dim + offs_d[None, :]
        tl.store(dst, tl.load(src, mask=mask), mask=mask)

    return copy_rows_kernel
