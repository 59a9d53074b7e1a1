"""Our CPU kernel for a refined site: the per-layer refinement and the attention over what it keeps, in one call.

``specontext::cpu_refine_attention`` (``csrc/refine_attention.cpp``) computes what
:func:`~.aten_step.refine_and_attend` computes for one query row per head once the
candidates are known (the selection's, plus the page rescue's tokens): the candidates'
logits (each key row read once for the group's query heads), the GQA ranking (max over the
group's heads of the softmax weight; SpeContext, arXiv 2512.00722, section 4), the sinks and
the recent window forced in, the ``budget`` best kept (``std::nth_element``, no sort), and
the softmax over the kept logits times their value rows. Inductor's code for the same body
gathers the keys, writes and rereads the logits and the softmax, runs ``aten::topk`` and a
``bmm`` over gathered values, about 0.5 ms per SmolLM2 layer at 8K where the bytes take
0.1 (``python -m benchmarks.layer_step``, docs/benchmarks.md, issue 51).

The kept set is the torch body's up to the order of exactly equal ranks (both take an
unordered top-k); values accumulate in float32 (the torch body's bfloat16 path rounds the
weights and the output of its value product to bfloat16). Built like the dense kernel
(:func:`.cpu_kernels.build_library`); where it cannot be built the site keeps inductor's body
(logged once).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_kernels
from .torch_private import counters

__all__ = ["applies", "available", "cpu_refine_attention", "refine_attend"]

_SOURCE = Path(__file__).with_name("csrc") / "refine_attention.cpp"
_MAX_GROUP, _MAX_DIM = 16, 256  # the kernel's stack arrays (csrc/refine_attention.cpp)
_STORE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_kernels.build_library(_SOURCE)
    for fn in (lib.specontext_refine_attention, lib.specontext_refine_attention_bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                       + [ctypes.c_int64] * 9)
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel library builds and loads here (the reason logged once if not)."""
    return cpu_kernels.loads(_library, "the CPU refined attention kernel", "refined CPU sites keep inductor's kernels")


def applies(query: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor], candidates: torch.Tensor,
            attn_mask: torch.Tensor | None, variant) -> bool:
    """Whether :func:`cpu_refine_attention` serves a refined site (a static fact, read at trace
    time): CPU tensors, one query row per head, a plain site (no soft cap, no sliding window),
    query and stores of one dtype, float32 or bfloat16, the group and head sizes the kernel
    holds, static shapes, no mask or a boolean one with one head (an additive mask may carry
    a bias the kernel does not add), and the library available."""
    key_cache, value_cache = store
    if isinstance(key_cache, tuple) or key_cache.dim() != 4:  # MLA's latent pair: not this kernel's
        return False
    b, num_heads, q_len, head_dim = query.shape
    num_kv = key_cache.shape[1]
    static = all(isinstance(n, int) for n in (*query.shape, *key_cache.shape, *candidates.shape))
    return (static and query.device.type == "cpu" and q_len == 1 and variant.plain
            and num_heads % num_kv == 0 and num_heads // num_kv <= _MAX_GROUP and head_dim <= _MAX_DIM
            and tuple(value_cache.shape) == tuple(key_cache.shape) and candidates.shape[-1] > 0
            and query.dtype in _STORE_DTYPES and key_cache.dtype == value_cache.dtype == query.dtype
            and (attn_mask is None or attn_mask.dtype == torch.bool and attn_mask.shape[1] == 1)
            and available())


def refine_attend(query: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor], candidates: torch.Tensor,
                  length: torch.Tensor, visible: torch.Tensor | None, spec, variant) -> torch.Tensor:
    """:func:`~.aten_step.refine_and_attend` of a site :func:`applies` to, once its candidates
    (the page rescue's included) are known: the budget, sinks and recent window as
    :func:`~.aten_step.ranked` derives them from ``spec`` for one query row; the query scaled
    in float32 and rounded to the store's dtype, as :func:`~.sparse_attention.query_key_logits`
    does. ``visible``: bool ``[batch|1, capacity]`` or None. Returns ``[batch, num_heads, 1,
    head_dim]`` in ``query.dtype``."""
    key_cache, value_cache = store
    budget = min(spec.budget, candidates.shape[-1])
    if budget < 1:
        raise ValueError(f"a refined selection of {budget} tokens cannot hold the step's 1 token")
    recent = min(max(spec.recent_window, 1), budget)
    sinks = min(spec.sink_tokens, budget - recent)
    q = (query.float() * variant.scale).to(key_cache.dtype).float()
    out = torch.ops.specontext.cpu_refine_attention(q, key_cache, value_cache, candidates, length, visible,
                                                    budget, sinks, recent)
    return out.to(query.dtype)


# A plain torch.library op, not ``custom_op``: its dispatch costs about 60 us less a call (30
# calls a step), and the kernel has no gradient to register.
torch.library.define("specontext::cpu_refine_attention",
                     "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor candidates, Tensor length, "
                     "Tensor? visible, int budget, int sinks, int recent) -> Tensor")


def cpu_refine_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         candidates: torch.Tensor, length: torch.Tensor, visible: torch.Tensor | None,
                         budget: int, sinks: int, recent: int) -> torch.Tensor:
    """A refined site's attention for one query row per head (the module's docstring).

    Args:
        query: float32 ``[batch, num_heads, 1, head_dim]``, already multiplied by the softmax scale.
        key_cache, value_cache: float32 or bfloat16 (both the same) ``[batch, num_kv_heads,
            capacity, head_dim]``.
        candidates: int64 ``[batch, num_kv_heads, slots]``: store positions, ``-1`` = empty;
            the first ``sinks`` non-empty ones are the row's sinks (a selection node's
            ascending output, then the page rescue's tokens); no position twice.
        length: int64 ``[]`` or ``[batch]``: tokens written, this step's included; a candidate
            at or past it is not attended.
        visible: None or bool ``[batch|1, capacity]``: False hides a slot (left padding).
        budget: candidates kept (``1 <= budget``); sinks, recent: the forced ones (the first
            ``sinks`` non-empty candidates, and the visible ones at positions ``length - recent
            .. length - 1``; the torch body also forces positions past ``length``, which a
            step's candidates never hold).

    Returns:
        float32 ``[batch, num_heads, 1, head_dim]`` (a head that sees none of the kept slots: zeros).

    Raises:
        KernelBuildError: the library cannot be built here (see :func:`available`).
        ValueError: shapes, dtypes or counts the kernel does not take, named before any read.
    """
    counters["specontext"]["cpu_kernel_refine_calls"] += 1
    _check_inputs(query, key_cache, value_cache, candidates, length, visible, budget, sinks, recent)
    b, num_heads, _, head_dim = query.shape
    num_kv, capacity = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty(b, num_heads, 1, head_dim, dtype=torch.float32)
    if capacity == 0:
        return out.zero_()
    q, k, v, cand, n = (t.contiguous() for t in (query, key_cache, value_cache, candidates, length))
    if visible is not None:
        visible = visible.reshape(-1, capacity).contiguous()
    lib = _library()
    kernel = lib.specontext_refine_attention_bf16 if k.dtype == torch.bfloat16 else lib.specontext_refine_attention
    status = kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), cand.data_ptr(), n.data_ptr(), 1 if n.numel() > 1 else 0,
                    visible.data_ptr() if visible is not None else None,
                    capacity if visible is not None and visible.shape[0] > 1 else 0,
                    out.data_ptr(), b, num_kv, num_heads // num_kv, capacity, head_dim, cand.shape[-1],
                    budget, sinks, recent)
    if status != 0:
        raise ValueError(f"cpu_refine_attention rejected query {tuple(query.shape)}, keys {tuple(key_cache.shape)}, "
                         f"candidates {tuple(candidates.shape)}, budget {budget}")
    return out


def _check_inputs(query, key_cache, value_cache, candidates, length, visible, budget, sinks, recent) -> None:
    """What the kernel reads, checked first: a ValueError naming the argument, never a read
    out of bounds (the dense kernel's checks, :func:`.cpu_kernels.check_inputs`, and the candidates')."""
    cpu_kernels.check_inputs(query, key_cache, value_cache, length, visible, "cpu_refine_attention")
    b, num_kv = key_cache.shape[:2]
    if (candidates.dtype != torch.int64 or candidates.device.type != "cpu" or candidates.dim() != 3
            or tuple(candidates.shape[:2]) != (b, num_kv) or candidates.shape[2] == 0):
        raise ValueError(f"cpu_refine_attention: candidates must be int64 [batch={b}, num_kv_heads={num_kv}, slots>0] "
                         f"on the CPU, got {candidates.dtype} {tuple(candidates.shape)} on {candidates.device}")
    if not (1 <= budget and 0 <= sinks and 0 <= recent):
        raise ValueError(f"cpu_refine_attention: budget must be >= 1 and sinks, recent >= 0; got budget={budget}, "
                         f"sinks={sinks}, recent={recent}")


torch.library.impl("specontext::cpu_refine_attention", "CPU")(cpu_refine_attention)


@torch.library.register_fake("specontext::cpu_refine_attention")
def _(query, key_cache, value_cache, candidates, length, visible, budget, sinks, recent):
    return query.new_empty(query.shape)
