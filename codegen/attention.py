"""Validated Python wrappers of the generated sparse decode attention kernels.

SpeContext (arXiv 2512.00722), section 4: after the retrieval head has selected, per request
and KV head, the token positions worth attending to, every layer of the LLM attends only to
those positions. These wrappers check inputs, build the ``KernelSpec`` of the call, pick the
flash-decoding split and launch the Triton kernels (``codegen/kernels.py``, through
``codegen.launch``).
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from .launch import interpreter_enabled, launch
from .reference import expand_valid_length
from .spec import KernelSpec, canonical_dtype

__all__ = [
    "MAX_SPLITS",
    "check_selection",
    "choose_splits",
    "sparse_decode_attention",
    "sparse_mla_decode_attention",
]

logger = logging.getLogger(__name__)

#: most splits of one selection (the merge kernel holds all of them in one tile)
MAX_SPLITS = 128


class Splits(NamedTuple):
    """How a selection of ``budget`` entries is cut across programs."""

    num_splits: int
    split_size: int  # selection entries per program, a multiple of block_n


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(
    budget: int, block_n: int, programs: int, device: torch.device, num_splits: int | None = None
) -> Splits:
    """Flash-decoding split of a selection of ``budget`` entries.

    On CUDA, aims at about four programs per SM (``programs`` = programs per split, i.e.
    batch x KV heads x row tiles) so that enough gathered rows are in flight to keep HBM
    busy; elsewhere (interpreter) one split unless ``num_splits`` asks otherwise. Splits hold
    whole ``block_n`` blocks; empty splits are never launched.
    """
    blocks = max(1, math.ceil(budget / block_n))
    if num_splits is None:
        target = 4 * _sm_count(device) if device.type == "cuda" else 1
        num_splits = math.ceil(target / max(1, programs))
    num_splits = max(1, min(int(num_splits), blocks, MAX_SPLITS))
    per_split = math.ceil(blocks / num_splits)
    return Splits(math.ceil(blocks / per_split), per_split * block_n)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_tensor(name: str, t: object, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _require(t.dim() == dim, f"{name} must have {dim} dims, got shape {tuple(t.shape)}")


def _check_options(scale: float, soft_cap: float | None, sliding_window: int | None) -> None:
    _require(
        isinstance(scale, (int, float)) and math.isfinite(scale),
        f"scale must be a finite float, got {scale!r}",
    )
    if soft_cap is not None:
        _require(
            isinstance(soft_cap, (int, float)) and math.isfinite(soft_cap) and soft_cap > 0,
            f"soft_cap must be a positive float or None, got {soft_cap!r}",
        )
    if sliding_window is not None:
        _require(
            isinstance(sliding_window, int)
            and not isinstance(sliding_window, bool)
            and sliding_window >= 1,
            f"sliding_window must be an int >= 1 or None, got {sliding_window!r}",
        )


def _first_bad(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0].tolist())


def check_selection(indices: torch.Tensor, valid_length: torch.Tensor, capacity: int) -> None:
    """Reject selections that would read unwritten cache slots (synchronises the device).

    Args:
        indices: int64 ``[batch, num_kv_heads, budget]``.
        valid_length: int64 ``[batch]`` tokens written per request.
        capacity: cache slots per (request, KV head).

    Raises:
        ValueError: naming the first offending entry when a valid length is outside
            ``[0, capacity]``, an index is ``< -1``, ``>= valid_length`` or ``>= capacity``, or
            a position is selected twice in one row.
    """
    bad_len = (valid_length < 0) | (valid_length > capacity)
    if bool(bad_len.any()):
        (b,) = _first_bad(bad_len)
        raise ValueError(
            f"valid_length[{b}] = {int(valid_length[b])} is outside [0, capacity="
            f"{capacity}]: the cache holds only {capacity} slots per head"
        )
    vlen = valid_length.view(-1, 1, 1)
    bad = (indices < -1) | (indices >= vlen) | (indices >= capacity)
    if bool(bad.any()):
        b, h, n = _first_bad(bad)
        value = int(indices[b, h, n])
        raise ValueError(
            f"indices[{b}, {h}, {n}] = {value} is invalid for valid_length[{b}] = "
            f"{int(valid_length[b])} (capacity {capacity}): selected positions must lie in "
            f"[0, valid_length) because slots at or past valid_length were never written. "
            f"Fix the selection (e.g. clamp it with indices < valid_length) and use -1 for "
            f"padding slots."
        )
    if indices.shape[-1] > 1:
        ordered = indices.sort(dim=-1).values
        dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
        if bool(dup.any()):
            b, h, n = _first_bad(dup)
            raise ValueError(
                f"position {int(ordered[b, h, n])} is selected twice for request "
                f"{b}, KV head {h}: selected positions must be unique per row "
                f"(use -1 for unused slots)"
            )


def _prepare_valid_length(
    valid_length: torch.Tensor | int, batch: int, device: torch.device
) -> torch.Tensor:
    if isinstance(valid_length, torch.Tensor):
        _require(
            not valid_length.is_floating_point()
            and not valid_length.is_complex()
            and valid_length.dtype != torch.bool,
            f"valid_length must be an integer tensor, got {valid_length.dtype}",
        )
        _require(
            valid_length.dim() == 0 or tuple(valid_length.shape) == (batch,),
            f"valid_length must have shape [] or [{batch}], got {tuple(valid_length.shape)}",
        )
        _require(
            valid_length.device == device,
            f"valid_length is on {valid_length.device} but query is on {device}",
        )
        valid_length = valid_length.to(torch.int64)
    return expand_valid_length(valid_length, batch, device)


def _check_out(
    out: torch.Tensor | None, shape: tuple[int, ...], query: torch.Tensor
) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=query.dtype, device=query.device)
    _check_tensor("out", out, 4)
    _require(
        tuple(out.shape) == shape and out.dtype == query.dtype and out.device == query.device,
        f"out must be {shape} {query.dtype} on {query.device}, got {tuple(out.shape)} "
        f"{out.dtype} on {out.device}",
    )
    return out


def _check_indices_tensor(indices: object, batch: int, num_kv: int, device: torch.device) -> None:
    _check_tensor("indices", indices, 3)
    _require(indices.dtype == torch.int64, f"indices must be int64, got {indices.dtype}")
    _require(
        tuple(indices.shape[:2]) == (batch, num_kv),
        f"indices must be [batch={batch}, num_kv_heads={num_kv}, budget], got "
        f"{tuple(indices.shape)}",
    )
    _require(indices.device == device, f"indices is on {indices.device}, query on {device}")


def _check_caches(
    query: torch.Tensor, caches: dict[str, torch.Tensor], widths: dict[str, int]
) -> tuple[int, int]:
    """Common checks of query and caches; returns (num_kv_heads, capacity)."""
    ref_name = next(iter(caches))
    ref = caches[ref_name]
    batch, num_heads, q_len, _ = query.shape
    num_kv, capacity = ref.shape[1], ref.shape[2]
    for name, cache in caches.items():
        _require(
            cache.dtype == query.dtype,
            f"{name} dtype {cache.dtype} differs from query dtype {query.dtype}",
        )
        _require(
            cache.device == query.device,
            f"{name} is on {cache.device} but query is on {query.device}",
        )
        _require(
            tuple(cache.shape[:3]) == (batch, num_kv, capacity),
            f"{name} must be [batch={batch}, num_kv_heads={num_kv}, capacity={capacity}, "
            f"dim], got {tuple(cache.shape)}",
        )
        if name in widths:
            _require(
                cache.shape[3] == widths[name],
                f"{name} last dim {cache.shape[3]} must equal {widths[name]}",
            )
    _require(
        num_kv >= 1 and num_heads % num_kv == 0,
        f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv}",
    )
    _require(1 <= q_len <= 16, f"q_len={q_len} must be in [1, 16]")
    canonical_dtype(query.dtype)  # raises ValueError for unsupported dtypes
    return num_kv, capacity


def _require_runnable(device: torch.device) -> None:
    """Compiled kernels need GPU tensors; CPU tensors need the interpreter."""
    _require(
        device.type != "cpu" or interpreter_enabled(),
        "the generated Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU "
        "tensors (slow; for tests); on CPU use the torch path (specontext_compile.runtime)",
    )


def _run(
    spec: KernelSpec,
    tensors: tuple[torch.Tensor, ...],
    indices: torch.Tensor,
    vlen: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    num_splits: int | None,
    wrap=None,
) -> torch.Tensor:
    _require_runnable(out.device)
    batch, num_heads, q_len, head_dim_v = out.shape
    num_kv = num_heads // spec.group
    splits = choose_splits(
        indices.shape[2], spec.block_n, batch * num_kv * spec.row_tiles, out.device, num_splits
    )
    part_out = torch.empty(
        (batch, num_heads, q_len, splits.num_splits, head_dim_v),
        dtype=torch.float32,
        device=out.device,
    )
    part_lse = torch.empty(
        (batch, num_heads, q_len, splits.num_splits), dtype=torch.float32, device=out.device
    )
    logger.debug("launch %s: splits=%s", spec.name, splits)
    launch(
        spec,
        tensors,
        indices,
        vlen,
        out,
        part_out,
        part_lse,
        scale=float(scale),
        soft_cap=float(soft_cap or 1.0),
        window=int(sliding_window or 0),
        split_size=splits.split_size,
        num_splits=splits.num_splits,
        wrap=wrap,
    )
    return out


def sparse_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    indices: torch.Tensor,
    valid_length: torch.Tensor | int,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    check_indices: bool = True,
    num_splits: int | None = None,
    block_n: int = 0,
    out: torch.Tensor | None = None,
    wrap=None,
) -> torch.Tensor:
    """Attention of each query row over the selected cache positions only (generated Triton).

    SpeContext (arXiv 2512.00722), section 4. Query head ``h`` uses KV head
    ``h // (num_heads // num_kv_heads)``. Row ``r`` (0-based) of the ``q_len`` query tokens may
    attend to a selected position ``p`` iff ``p <= valid_length - q_len + r`` (and, with a
    sliding window ``W``, ``p > valid_length - q_len + r - W``). Logits are
    ``(q . k) * scale``, optionally ``soft_cap * tanh(logits / soft_cap)``; softmax and sums in
    fp32.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``, fp32/bf16/fp16, ``q_len`` in 1..16.
        key_cache: ``[batch, num_kv_heads, capacity, head_dim]``, same dtype; any strides
            (read in place, never copied).
        value_cache: ``[batch, num_kv_heads, capacity, head_dim_v]``, same dtype, any strides.
        indices: int64 ``[batch, num_kv_heads, budget]`` positions to attend, unique per row,
            any order; ``-1`` marks a padding slot. ``budget`` may exceed the context.
        valid_length: int64 tensor ``[]`` or ``[batch]`` (or an int): tokens written in the
            cache, this step's ``q_len`` included. Slots ``>= valid_length`` are never read.
        scale: logit scale (usually ``head_dim ** -0.5``).
        soft_cap: logit soft-cap (e.g. 50.0 for Gemma 2), or None.
        sliding_window: window ``W`` in tokens, or None.
        check_indices: validate the selection against ``valid_length`` and ``capacity``
            (synchronises the device); pass False on hot paths.
        num_splits: flash-decoding splits per selection (None = chosen for the device).
        block_n: selection entries per inner step (0 = chosen from the head dims).
        out: optional preallocated ``[batch, num_heads, q_len, head_dim_v]`` output.
        wrap: applied to each generated kernel before its launch:
            ``torch.library.wrap_triton`` inside a ``torch.library.triton_op`` (so that
            torch.compile sees and fuses the kernels: :mod:`~specontext_compile.runtime.kernel_step`);
            None launches them directly.

    Returns:
        ``[batch, num_heads, q_len, head_dim_v]`` in ``query.dtype``. A row with no allowed
        selected position is all zeros (never NaN).

    Raises:
        TypeError: when an argument is not a tensor.
        ValueError: on shape, dtype or device mismatch, ``num_heads % num_kv_heads != 0``,
            unsupported dtype or ``q_len``, invalid options, and (with ``check_indices``) on
            selected positions ``>= valid_length`` / ``>= capacity``, duplicates or
            ``valid_length > capacity``.
        ImportError: when triton is not installed.
    """
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        _check_tensor(name, t, 4)
    _check_options(scale, soft_cap, sliding_window)
    batch, num_heads, q_len, head_dim = query.shape
    num_kv, capacity = _check_caches(
        query, {"key_cache": key_cache, "value_cache": value_cache}, {"key_cache": head_dim}
    )
    _check_indices_tensor(indices, batch, num_kv, query.device)
    vlen = _prepare_valid_length(valid_length, batch, query.device)
    if check_indices:
        check_selection(indices, vlen, capacity)
    head_dim_v = value_cache.shape[3]
    spec = KernelSpec(
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        group=num_heads // num_kv,
        dtype=query.dtype,
        q_len=q_len,
        soft_cap=soft_cap is not None,
        sliding_window=sliding_window is not None,
        block_n=block_n,
    )
    out = _check_out(out, (batch, num_heads, q_len, head_dim_v), query)
    return _run(
        spec,
        (query, key_cache, value_cache),
        indices,
        vlen,
        out,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        num_splits=num_splits,
        wrap=wrap,
    )


def sparse_mla_decode_attention(
    query: torch.Tensor,
    query_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    indices: torch.Tensor,
    valid_length: torch.Tensor | int,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    check_indices: bool = True,
    num_splits: int | None = None,
    block_n: int = 0,
    out: torch.Tensor | None = None,
    wrap=None,
) -> torch.Tensor:
    """Sparse decode attention in the MLA (absorbed) layout.

    Equals ``sparse_decode_attention(cat([query, query_rope], -1), cat([latent_cache,
    rope_cache], -1), latent_cache, ...)`` without building the concatenations: the latent
    tile of each selected token is read once and serves as key part and as value
    (SpeContext section 3.2: with MLA only the selected latent entries are used).

    Args:
        query: ``[batch, num_heads, q_len, latent_dim]`` (query already absorbed into the
            latent space). query_rope: ``[batch, num_heads, q_len, rope_dim]``.
        latent_cache: ``[batch, num_kv_heads, capacity, latent_dim]`` (usually one KV head).
        rope_cache: ``[batch, num_kv_heads, capacity, rope_dim]``.
        indices, valid_length, scale, soft_cap, sliding_window, check_indices, num_splits,
        block_n, out, wrap: as in ``sparse_decode_attention``.

    Returns:
        ``[batch, num_heads, q_len, latent_dim]`` in ``query.dtype``.

    Raises:
        TypeError, ValueError, ImportError: as ``sparse_decode_attention``.
    """
    for name, t in (
        ("query", query),
        ("query_rope", query_rope),
        ("latent_cache", latent_cache),
        ("rope_cache", rope_cache),
    ):
        _check_tensor(name, t, 4)
    _check_options(scale, soft_cap, sliding_window)
    batch, num_heads, q_len, latent_dim = query.shape
    rope_dim = query_rope.shape[3]
    _require(
        rope_dim >= 1,
        "query_rope must have a RoPE width >= 1 (use "
        "sparse_decode_attention for layouts without a RoPE part)",
    )
    _require(
        tuple(query_rope.shape[:3]) == (batch, num_heads, q_len)
        and query_rope.dtype == query.dtype
        and query_rope.device == query.device,
        f"query_rope must be [{batch}, {num_heads}, {q_len}, rope_dim] {query.dtype} on "
        f"{query.device}, got {tuple(query_rope.shape)} {query_rope.dtype}",
    )
    num_kv, capacity = _check_caches(
        query,
        {"latent_cache": latent_cache, "rope_cache": rope_cache},
        {"latent_cache": latent_dim, "rope_cache": rope_dim},
    )
    _check_indices_tensor(indices, batch, num_kv, query.device)
    vlen = _prepare_valid_length(valid_length, batch, query.device)
    if check_indices:
        check_selection(indices, vlen, capacity)
    spec = KernelSpec(
        head_dim=latent_dim,
        rope_dim=rope_dim,
        group=num_heads // num_kv,
        dtype=query.dtype,
        q_len=q_len,
        soft_cap=soft_cap is not None,
        sliding_window=sliding_window is not None,
        block_n=block_n,
    )
    out = _check_out(out, (batch, num_heads, q_len, latent_dim), query)
    return _run(
        spec,
        (query, query_rope, latent_cache, rope_cache),
        indices,
        vlen,
        out,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        num_splits=num_splits,
        wrap=wrap,
    )
