"""Our CPU kernel for the default selection head's scores: one call per step over every retrieval layer.

``specontext::cpu_selection_scores`` (``csrc/selection_scores.cpp``) computes what
:func:`~.scorers.lagged_query_score` computes: per retrieval layer the softmax of its lagged
query over the written, visible positions, the max over each KV group's query heads
(SpeContext, arXiv 2512.00722, section 4), summed over the layers. Each key row is read once
for the group's heads, and only the written positions are read (inductor's fused body reads
the store's whole capacity, masked). Float32 accumulation; the query rounded to the store's
dtype first, as the torch body does. Built like the other CPU kernels
(:func:`.cpu_kernels.build_library`); where it cannot be built the step keeps inductor's body
(logged once).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_kernels
from .torch_private import counters

__all__ = ["applies", "available", "cpu_selection_scores", "int8_dot_calls", "lagged_scores"]

_SOURCE = Path(__file__).with_name("csrc") / "selection_scores.cpp"
_MAX_GROUP, _MAX_DIM, _MAX_LAYERS = 16, 256, 64  # the kernel's limits (csrc/selection_scores.cpp)
_STORE_DTYPES = cpu_kernels.STORE_DTYPES


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_kernels.load_kernels(_SOURCE, cpu_kernels.entry_names("specontext_selection_scores"),
                                   [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                                            ctypes.c_void_p] + [ctypes.c_int64] * 6)
    lib.specontext_selection_scores_int8_dot_calls.restype = ctypes.c_int64
    int8 = lib.specontext_selection_scores_int8  # int8 levels: one more pointer, the rows' scales
    int8.restype = ctypes.c_int
    int8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_void_p] + [ctypes.c_int64] * 6
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel library builds and loads here (the reason logged once if not)."""
    return cpu_kernels.loads(_library, "the CPU selection scores kernel", "the selection keeps inductor's kernels")


def int8_dot_calls() -> int:
    """Calls in this process whose int8 keys took the CPU's int8 dot products (AVX-512 VNNI,
    ``VPDPBUSD``; head_dim a multiple of 64 and an unrolled group shape); the others widened
    the levels to float32."""
    return int(_library().specontext_selection_scores_int8_dot_calls())


def applies(query_state: torch.Tensor, stores: list) -> bool:
    """Whether :func:`lagged_scores` serves a lagged-query selection (a static fact, asked once
    by the pass: :func:`~.routes.selection_kernel`): CPU tensors, plain key stores (not MLA's
    latent pairs) of one dtype, float32, bfloat16 or float16, and one shape ``[batch, num_kv_heads,
    capacity, head_dim]`` with static sizes, the recorded queries ``[slots >= layers, batch,
    num_heads, 1, head_dim]`` of that dtype, the group, head and layer counts the kernel
    holds, and the library available."""
    if not stores or query_state.device.type != "cpu":
        return False
    if any(not isinstance(s, torch.Tensor) or s.dim() != 4 for s in stores):
        return False
    shape, dtype = tuple(stores[0].shape), stores[0].dtype
    if any(tuple(s.shape) != shape or s.dtype != dtype or s.device.type != "cpu" for s in stores):
        return False
    b, num_kv, _, head_dim = shape
    static = all(isinstance(n, int) for n in (*shape, *query_state.shape))
    return (static and dtype in _STORE_DTYPES and query_state.dtype == dtype and query_state.dim() == 5
            and query_state.shape[0] >= len(stores) <= _MAX_LAYERS and query_state.shape[1] == b
            and query_state.shape[3] == 1 and query_state.shape[4] == head_dim and query_state.shape[2] % num_kv == 0
            and query_state.shape[2] // num_kv <= _MAX_GROUP and head_dim <= _MAX_DIM and available())


def lagged_scores(query_state: torch.Tensor, stores: list, cached: torch.Tensor, visible: torch.Tensor | None,
                  variant, mirrors: list | None = None) -> torch.Tensor:
    """:func:`~.scorers.lagged_query_score` where the pass chose the kernel (``StepSpec.cpu_kernel``): ``visible`` bool ``[batch|1,
    1, capacity]`` or None; returns float32 ``[batch, num_kv_heads, capacity]``. ``mirrors``:
    one ``(key_levels, key_scales)`` per store (:mod:`.key_mirror`, option
    ``selection_keys="int8"``), scored instead of the stores' keys; the query is rounded to the
    stores' dtype either way."""
    query = (query_state[: len(stores)].float() * variant.scale).to(stores[0].dtype).float()
    keys, scales = (list(stores), None) if mirrors is None else ([m[0] for m in mirrors], [m[1] for m in mirrors])
    return torch.ops.specontext.cpu_selection_scores(query, keys, cached, None if visible is None else visible[:, 0],
                                                     scales)


# A plain torch.library op (as cpu_refine_attention: a cheaper dispatch than custom_op's).
torch.library.define("specontext::cpu_selection_scores",
                     "(Tensor query, Tensor[] key_stores, Tensor length, Tensor? visible, Tensor[]? key_scales=None) "
                     "-> Tensor")


def cpu_selection_scores(query: torch.Tensor, key_stores: list[torch.Tensor], length: torch.Tensor,
                         visible: torch.Tensor | None, key_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The lagged-query head's scores (the module's docstring).

    Args:
        query: float32 ``[layers, batch, num_heads, 1, head_dim]``, each layer's lagged query
            already multiplied by the softmax scale (and rounded to the stores' dtype).
        key_stores: ``layers`` float32, bfloat16, float16 or int8 stores (one dtype and shape)
            ``[batch, num_kv_heads, capacity, head_dim]``; int8: each row's levels
            (:func:`~.int8_keys.quantize_rows`), the key being ``level * scale``.
        length: int64 ``[]`` or ``[batch]``: positions written (``0 .. length-1`` are scored).
        visible: None or bool ``[batch|1, capacity]``: False leaves a position out (left padding).
        key_scales: with int8 ``key_stores`` (and only then), ``layers`` float32 ``[batch,
            num_kv_heads, capacity]``: each row's scale. The query's rows are then rounded to
            int8 levels with a scale each too (:func:`~.int8_keys.quantize_rows`'s rounding),
            and a logit is ``(q_levels . k_levels) * q_scale * k_scale``: integer dot products
            (the CPU's ``VPDPBUSD`` where it has AVX-512 VNNI), two float32 roundings.

    Returns:
        float32 ``[batch, num_kv_heads, capacity]``: the sum over the layers of the group's
        largest softmax weight; 0 at positions not scored.

    Raises:
        KernelBuildError: the library cannot be built here (see :func:`available`).
        ValueError: shapes, dtypes or counts the kernel does not take, named before any read.
    """
    counters["specontext"]["cpu_kernel_selection_calls"] += 1
    _check_inputs(query, key_stores, length, visible)
    _check_scales(key_stores, key_scales)
    layers, b, num_heads, _, head_dim = query.shape
    num_kv, capacity = key_stores[0].shape[1], key_stores[0].shape[2]
    out = torch.empty(b, num_kv, capacity, dtype=torch.float32)
    if capacity == 0:
        return out
    stores = [s.contiguous() for s in key_stores]
    q, n = query.contiguous(), length.contiguous()
    if visible is not None:
        visible = visible.reshape(-1, capacity).contiguous()
    pointers = (ctypes.c_void_p * layers)(*(s.data_ptr() for s in stores))
    lib = _library()
    if key_scales is not None:  # int8 levels: the entry that scales each row's logits
        counters["specontext"]["cpu_kernel_selection_int8_calls"] += 1
        scales = [t.contiguous() for t in key_scales]
        scale_pointers = (ctypes.c_void_p * layers)(*(t.data_ptr() for t in scales))
        kernel = functools.partial(lib.specontext_selection_scores_int8, q.data_ptr(), pointers, scale_pointers)
    else:
        kernel = functools.partial(cpu_kernels.entry(lib, "specontext_selection_scores", stores[0].dtype),
                                   q.data_ptr(), pointers)
    status = kernel(n.data_ptr(), 1 if n.numel() > 1 else 0,
                    visible.data_ptr() if visible is not None else None,
                    capacity if visible is not None and visible.shape[0] > 1 else 0,
                    out.data_ptr(), layers, b, num_kv, num_heads // num_kv, capacity, head_dim)
    if status != 0:
        raise ValueError(f"cpu_selection_scores rejected query {tuple(query.shape)}, stores {tuple(stores[0].shape)}")
    return out


torch.library.impl("specontext::cpu_selection_scores", "CPU")(cpu_selection_scores)


def _check_inputs(query, key_stores, length, visible) -> None:
    """What the kernel reads, checked first: a ValueError naming the argument."""
    if not key_stores or len(key_stores) > _MAX_LAYERS:
        raise ValueError(f"cpu_selection_scores takes 1 to {_MAX_LAYERS} key stores, got {len(key_stores)}")
    first = key_stores[0]
    for i, s in enumerate(key_stores):
        if (s.dim() != 4 or s.dtype not in (*_STORE_DTYPES, torch.int8) or s.device.type != "cpu"
                or s.dtype != first.dtype or tuple(s.shape) != tuple(first.shape)):
            raise ValueError(f"cpu_selection_scores: key_stores[{i}] must be a float32, bfloat16, float16 or int8 CPU tensor "
                             f"[batch, num_kv_heads, capacity, head_dim] like key_stores[0] ({first.dtype} "
                             f"{tuple(first.shape)}), got {s.dtype} {tuple(s.shape)} on {s.device}")
    b, num_kv, capacity, head_dim = first.shape
    if (query.dtype != torch.float32 or query.device.type != "cpu" or query.dim() != 5
            or tuple(query.shape[:2]) != (len(key_stores), b) or query.shape[3] != 1 or query.shape[4] != head_dim
            or num_kv == 0 or query.shape[2] % num_kv or query.shape[2] // num_kv > _MAX_GROUP
            or head_dim > _MAX_DIM):
        raise ValueError(f"cpu_selection_scores: query must be float32 [layers={len(key_stores)}, batch={b}, "
                         f"num_heads (a multiple of {num_kv}, at most {_MAX_GROUP} per KV head), 1, "
                         f"head_dim={head_dim} <= {_MAX_DIM}] on the CPU, got {query.dtype} {tuple(query.shape)}")
    if length.dtype != torch.int64 or length.numel() not in (1, b) or length.device.type != "cpu":
        raise ValueError(f"cpu_selection_scores: length must be int64 with 1 or {b} entries on the CPU, got "
                         f"{length.dtype} {tuple(length.shape)}")
    if visible is not None and (visible.dtype != torch.bool or visible.shape[-1] != capacity
                                or visible.numel() not in (capacity, b * capacity) or visible.device.type != "cpu"):
        raise ValueError(f"cpu_selection_scores: visible must be bool [1 or {b}, {capacity}] on the CPU, got "
                         f"{visible.dtype} {tuple(visible.shape)}")


def _check_scales(key_stores, key_scales) -> None:
    """int8 stores come with one float32 scale per row, and only they do."""
    first = key_stores[0]
    if first.dtype != torch.int8:
        if key_scales is not None:
            raise ValueError(f"cpu_selection_scores: key_scales go with int8 key_stores (their rows' scales), "
                             f"got {first.dtype} stores: pass key_scales=None")
        return
    rows = tuple(first.shape[:3])
    if key_scales is None or len(key_scales) != len(key_stores) or any(
            t.dtype != torch.float32 or tuple(t.shape) != rows or t.device.type != "cpu" for t in key_scales):
        got = None if key_scales is None else [(t.dtype, tuple(t.shape)) for t in key_scales]
        raise ValueError(f"cpu_selection_scores: int8 key_stores need key_scales, {len(key_stores)} float32 CPU "
                         f"tensors {list(rows)} (one scale per row: int8_keys.quantize_rows), got {got}")


@torch.library.register_fake("specontext::cpu_selection_scores")
def _(query, key_stores, length, visible, key_scales=None):
    b, num_kv, capacity = key_stores[0].shape[:3]
    return query.new_empty(b, num_kv, capacity)
