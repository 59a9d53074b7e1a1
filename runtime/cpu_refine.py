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
from collections.abc import Sequence
from pathlib import Path

import torch

from . import cpu_kernels
from .torch_private import counters

__all__ = ["applies", "available", "cpu_refine_attention", "cpu_rescue_candidates", "refine_attend", "rescue"]

_SOURCE = Path(__file__).with_name("csrc") / "refine_attention.cpp"
_MAX_GROUP, _MAX_DIM = 16, 256  # the kernel's stack arrays (csrc/refine_attention.cpp)
_STORE_DTYPES = cpu_kernels.STORE_DTYPES


@functools.cache
def _library() -> ctypes.CDLL:
    return cpu_kernels.load_kernels(_SOURCE, cpu_kernels.entry_names("specontext_refine_attention"),
                                    [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                                    + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 12, op_calls="cpu_kernel_refine_calls")


@functools.cache
def available() -> bool:
    """Whether the kernel library builds and loads here (the reason logged once if not)."""
    return cpu_kernels.loads(_library, "the CPU refined attention kernel", "refined CPU sites keep inductor's kernels")


def applies(query: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor], slots: int,
            attn_mask: torch.Tensor | None, variant, pages: Sequence[torch.Tensor | None] = ()) -> bool:
    """Whether :func:`cpu_refine_attention` serves a refined site ranking ``slots`` candidates
    per KV head (a static fact, asked once by the pass: :func:`~.routes.cpu_kernel`): CPU
    tensors, one query row per head, a plain site (no soft cap, no sliding window), query and
    stores of one dtype, float32, bfloat16 or float16, the group and head sizes the kernel holds,
    static shapes, no gradient to carry (the op has no backward: a step traced with gradients
    keeps the torch body), no mask or a boolean one with one head (an additive mask may carry
    a bias the kernel does not add), page bounds (when given: ``(page_min, page_max,
    page_shift)``) of the store's dtype and ``[batch, num_kv_heads, pages, head_dim]``, and the
    library available."""
    key_cache, value_cache = store
    if isinstance(key_cache, tuple) or key_cache.dim() != 4:  # MLA's latent pair: not this kernel's
        return False
    _, num_heads, q_len, head_dim = query.shape
    num_kv = key_cache.shape[1]
    static = all(isinstance(n, int) for n in (*query.shape, *key_cache.shape, slots))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key_cache, value_cache))
    return (static and not grad and query.device.type == "cpu" and q_len == 1 and variant.plain
            and num_heads % num_kv == 0 and num_heads // num_kv <= _MAX_GROUP and head_dim <= _MAX_DIM
            and tuple(value_cache.shape) == tuple(key_cache.shape) and slots > 0
            and query.dtype in _STORE_DTYPES and key_cache.dtype == value_cache.dtype == query.dtype
            and (attn_mask is None or attn_mask.dtype == torch.bool and attn_mask.shape[1] == 1)
            and _bounds_apply(pages, key_cache) and available())


def _bounds_apply(pages: Sequence[torch.Tensor | None], key_cache: torch.Tensor) -> bool:
    if not pages:
        return True
    page_min, page_max, shift = pages
    b, num_kv, _, head_dim = key_cache.shape
    return (page_min.dtype == page_max.dtype == key_cache.dtype and page_min.dim() == 4
            and tuple(page_min.shape) == tuple(page_max.shape) and tuple(page_min.shape[:2]) == (b, num_kv)
            and page_min.shape[3] == head_dim and all(isinstance(n, int) for n in page_min.shape)
            and (shift is None or shift.dtype == torch.int64 and shift.numel() == b))


def _rescue_args(spec, pages: Sequence[torch.Tensor | None]):
    """``(page_min, page_max, page_shift, rescue_pages, page_tokens)`` of the kernel's page rescue
    (``pages`` = ``(page_min, page_max, page_shift)``, or empty: off)."""
    if not pages:
        return None, None, None, 0, 0
    page_min, page_max, shift = pages
    return page_min, page_max, shift, min(spec.rescue_pages, page_min.shape[2]), spec.page_tokens


def refine_attend(query: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor], candidates: torch.Tensor,
                  length: torch.Tensor, visible: torch.Tensor | None, spec, variant,
                  pages: Sequence[torch.Tensor | None] = (), gathered: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """:func:`~.aten_step.refine_and_attend` of a site :func:`applies` to: ``candidates`` the
    selection's (with ``pages``, ``(page_min, page_max, page_shift)``, the kernel adds the page
    rescue's tokens, ``spec.rescue_pages`` pages of ``spec.page_tokens``) or the positions the
    site ranks (no rescue); the budget, sinks and recent window as
    :func:`~.aten_step.ranked` derives them from ``spec`` for one query row over the candidates
    and rescued slots. ``visible``: bool ``[batch|1, capacity]`` or None. ``gathered``: the
    candidates' ``(keys, values)`` rows ``[batch, num_kv_heads, slots, head_dim]`` read
    elsewhere (an offloaded layer's buffer, :mod:`.offload_step`; no rescue then: the
    candidates are :func:`rescue`'s), read instead of ``store``. Returns ``[batch, num_heads, 1,
    head_dim]`` in ``query.dtype``."""
    key_cache, value_cache = store
    page_min, page_max, shift, rescue, page_tokens = _rescue_args(spec, pages)
    budget = min(spec.budget, candidates.shape[-1] + rescue * page_tokens)
    if budget < 1:
        raise ValueError(f"a refined selection of {budget} tokens cannot hold the step's 1 token")
    recent = min(max(spec.recent_window, 1), budget)
    sinks = min(spec.sink_tokens, budget - recent)
    keys, values = gathered if gathered is not None else (None, None)
    scaled = query.float() * variant.scale
    # checked once here, on the traced values (the op's C++ kernel checks what guards memory)
    _check_inputs(scaled, key_cache, value_cache, candidates, length, visible, budget, sinks, recent)
    _check_gathered(key_cache, candidates, keys, values, _check_pages(key_cache, page_min, page_max, shift, rescue,
                                                                      page_tokens))
    out = torch.ops.specontext.cpu_refine_attention(scaled, key_cache, value_cache, candidates, length, visible,
                                                    page_min, page_max, shift, keys, values, budget, sinks, recent,
                                                    rescue, page_tokens)
    return out.to(query.dtype)


def rescue(query: torch.Tensor, key_cache: torch.Tensor, candidates: torch.Tensor, length: torch.Tensor,
           visible: torch.Tensor | None, spec, variant, pages: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The candidates :func:`refine_attend` ranks after its page rescue, int64 ``[batch,
    num_kv_heads, slots + rescue_pages * page_tokens]`` (the kernel's phase 0 alone): an
    offloaded layer loads these rows, then calls :func:`refine_attend` with them (``gathered``),
    and ranks and attends exactly as a resident layer does (the same kernel over the same
    candidates and rows: bit-identical)."""
    page_min, page_max, shift, rescue_pages, page_tokens = _rescue_args(spec, pages)
    return torch.ops.specontext.cpu_rescue_candidates(query.float() * variant.scale, key_cache, candidates, length,
                                                      visible, page_min, page_max, shift, rescue_pages, page_tokens)


# Plain torch.library ops, not ``custom_op``: their dispatch costs about 60 us less a call (30
# calls a step), and the kernel has no gradient to register (:func:`applies` keeps it out of
# steps traced with gradients).
torch.library.define("specontext::cpu_refine_attention",
                     "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor candidates, Tensor length, "
                     "Tensor? visible, Tensor? page_min, Tensor? page_max, Tensor? page_shift, Tensor? gathered_keys, "
                     "Tensor? gathered_values, int budget, int sinks, int recent, int rescue_pages, int page_tokens) "
                     "-> Tensor")
torch.library.define("specontext::cpu_rescue_candidates",
                     "(Tensor query, Tensor key_cache, Tensor candidates, Tensor length, Tensor? visible, "
                     "Tensor? page_min, Tensor? page_max, Tensor? page_shift, int rescue_pages, int page_tokens) "
                     "-> Tensor")


def cpu_refine_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         candidates: torch.Tensor, length: torch.Tensor, visible: torch.Tensor | None,
                         page_min: torch.Tensor | None, page_max: torch.Tensor | None,
                         page_shift: torch.Tensor | None, gathered_keys: torch.Tensor | None,
                         gathered_values: torch.Tensor | None, budget: int, sinks: int, recent: int,
                         rescue_pages: int = 0, page_tokens: int = 0) -> torch.Tensor:
    """A refined site's attention for one query row per head (the module's docstring).

    Args:
        query: float32 ``[batch, num_heads, 1, head_dim]``, already multiplied by the softmax
            scale (the page bounds read it as it is, the logits rounded to the store's dtype, as
            the torch body does).
        key_cache, value_cache: float32, bfloat16 or float16 (both the same) ``[batch, num_kv_heads,
            capacity, head_dim]``.
        candidates: int64 ``[batch, num_kv_heads, slots]``: store positions, ``-1`` = empty;
            the first ``sinks`` non-empty ones are the row's sinks (a selection node's
            ascending output, then the page rescue's tokens); no position twice.
        length: int64 ``[]`` or ``[batch]``: tokens written, this step's included; a candidate
            at or past it is not attended.
        visible: None or bool ``[batch|1, capacity]``: False hides a slot (left padding).
        page_min, page_max: None, or the store's per-page key bounds (its dtype) ``[batch,
            num_kv_heads, pages, head_dim]``; page ``p`` of row ``b`` holds positions ``p *
            page_tokens - page_shift[b]`` onwards (``page_shift`` int64 ``[batch]`` or None = 0).
        gathered_keys, gathered_values: None, or the candidates' rows ``[batch, num_kv_heads,
            slots, head_dim]`` (the stores' dtype), read instead of the stores (no rescue then).
        budget: candidates kept (``1 <= budget``); sinks, recent: the forced ones (the first
            ``sinks`` non-empty candidates, and the visible ones at positions ``length - recent
            .. length - 1``; the torch body also forces positions past ``length``, which a
            step's candidates never hold).
        rescue_pages, page_tokens: the page rescue (``runtime/page_bounds.py``): the tokens of
            the ``rescue_pages`` pages with the highest Quest bound join the candidates (0 = off).

    Returns:
        float32 ``[batch, num_heads, 1, head_dim]`` (a head that sees none of the kept slots: zeros).

    Raises:
        KernelBuildError: the library cannot be built here (see :func:`available`).
        ValueError: shapes, dtypes or counts the kernel does not take, named before any read.
    """
    counters["specontext"]["cpu_kernel_refine_calls"] += 1
    _check_inputs(query, key_cache, value_cache, candidates, length, visible, budget, sinks, recent)
    rescue_pages = _check_pages(key_cache, page_min, page_max, page_shift, rescue_pages, page_tokens)
    _check_gathered(key_cache, candidates, gathered_keys, gathered_values, rescue_pages)
    b, num_heads, _, head_dim = query.shape
    out = torch.empty(b, num_heads, 1, head_dim, dtype=torch.float32)
    if key_cache.shape[2] == 0:
        return out.zero_()
    _run(query, key_cache, value_cache, candidates, length, visible, (page_min, page_max, page_shift),
         (gathered_keys, gathered_values), None, out, budget, sinks, recent, rescue_pages, page_tokens)
    return out


def cpu_rescue_candidates(query: torch.Tensor, key_cache: torch.Tensor, candidates: torch.Tensor,
                          length: torch.Tensor, visible: torch.Tensor | None, page_min: torch.Tensor | None,
                          page_max: torch.Tensor | None, page_shift: torch.Tensor | None, rescue_pages: int,
                          page_tokens: int) -> torch.Tensor:
    """The candidates after the kernel's page rescue (:func:`rescue`), arguments as
    :func:`cpu_refine_attention`'s; int64 ``[batch, num_kv_heads, slots + rescue_pages *
    page_tokens]`` (``rescue_pages`` clamped to the pages there are)."""
    _check_inputs(query, key_cache, key_cache, candidates, length, visible, 1, 0, 0)
    rescue_pages = _check_pages(key_cache, page_min, page_max, page_shift, rescue_pages, page_tokens)
    out = torch.empty(*candidates.shape[:2], candidates.shape[2] + rescue_pages * page_tokens, dtype=torch.int64)
    if key_cache.shape[2] == 0:
        return out.fill_(-1)
    _run(query, key_cache, key_cache, candidates, length, visible, (page_min, page_max, page_shift), (None, None),
         out, None, 1, 0, 0, rescue_pages, page_tokens)
    return out


def _run(query, key_cache, value_cache, candidates, length, visible, pages, gathered, union_out, out, budget, sinks,
         recent, rescue_pages, page_tokens) -> None:
    """Call the kernel on checked inputs (contiguous copies where needed)."""
    b, num_heads, _, head_dim = query.shape
    num_kv, capacity = key_cache.shape[1], key_cache.shape[2]
    q, k, v, cand, n = (t.contiguous() for t in (query, key_cache, value_cache, candidates, length))
    lo, hi, shift = ((t.contiguous() if t is not None else None) for t in pages)
    gk, gv = ((t.contiguous() if t is not None else None) for t in gathered)
    if visible is not None:
        visible = visible.reshape(-1, capacity).contiguous()
    lib = _library()
    kernel = cpu_kernels.entry(lib, "specontext_refine_attention", k.dtype)
    status = kernel(q.data_ptr(), k.data_ptr(), v.data_ptr(), cand.data_ptr(), n.data_ptr(), 1 if n.numel() > 1 else 0,
                    _pointer(visible), capacity if visible is not None and visible.shape[0] > 1 else 0,
                    _pointer(lo), _pointer(hi), _pointer(shift), _pointer(gk), _pointer(gv), _pointer(union_out),
                    _pointer(out), b, num_kv, num_heads // num_kv, capacity, head_dim, cand.shape[-1],
                    lo.shape[2] if rescue_pages else 0, rescue_pages, page_tokens, budget, sinks, recent)
    if status != 0:
        raise ValueError(f"cpu_refine_attention rejected query {tuple(query.shape)}, keys {tuple(key_cache.shape)}, "
                         f"candidates {tuple(candidates.shape)}, budget {budget}")


def _check_gathered(key_cache, candidates, gathered_keys, gathered_values, rescue_pages: int) -> None:
    """Gathered rows (when given): both, the stores' dtype, one row per candidate, no rescue."""
    if gathered_keys is None and gathered_values is None:
        return
    want = (*candidates.shape, key_cache.shape[3])
    for name, t in (("gathered_keys", gathered_keys), ("gathered_values", gathered_values)):
        if t is None or t.dtype != key_cache.dtype or t.device.type != "cpu" or tuple(t.shape) != want:
            raise ValueError(f"cpu_refine_attention: {name} must be {key_cache.dtype} {list(want)} on the CPU (one row "
                             f"per candidate) with the other, got {None if t is None else (t.dtype, tuple(t.shape))}")
    if rescue_pages:
        raise ValueError("cpu_refine_attention: gathered rows take the rescued candidates (cpu_rescue_candidates), "
                         "not the page rescue again")


def _pointer(t: torch.Tensor | None):
    return t.data_ptr() if t is not None else None


def _check_pages(key_cache, page_min, page_max, page_shift, rescue_pages: int, page_tokens: int) -> int:
    """The page rescue's inputs checked (a ValueError naming the argument); returns the pages
    rescued (0 when off)."""
    if rescue_pages == 0:
        return 0
    b, num_kv, _, head_dim = key_cache.shape
    if page_min is None or page_max is None or rescue_pages < 0 or page_tokens < 1:
        raise ValueError(f"cpu_refine_attention: the page rescue needs page_min and page_max and rescue_pages, "
                         f"page_tokens >= 1; got rescue_pages={rescue_pages}, page_tokens={page_tokens}")
    for name, t in (("page_min", page_min), ("page_max", page_max)):
        if (t.dtype != key_cache.dtype or t.device.type != "cpu" or t.dim() != 4
                or tuple(t.shape[:2]) != (b, num_kv) or t.shape[3] != head_dim or t.shape[2] < 1
                or tuple(t.shape) != tuple(page_min.shape)):
            raise ValueError(f"cpu_refine_attention: {name} must be {key_cache.dtype} [batch={b}, num_kv_heads={num_kv}, "
                             f"pages, head_dim={head_dim}] on the CPU like the other bound, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if page_shift is not None and (page_shift.dtype != torch.int64 or page_shift.numel() != b
                                   or page_shift.device.type != "cpu"):
        raise ValueError(f"cpu_refine_attention: page_shift must be int64 [batch={b}] on the CPU or None, got "
                         f"{page_shift.dtype} {tuple(page_shift.shape)}")
    return min(rescue_pages, page_min.shape[2])


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


# cpu_refine_attention's CPU kernel is C++ where the library is built with it (csrc/torch_op.h);
# this Python kernel serves it elsewhere
torch.library.impl("specontext::cpu_refine_attention", "CompositeExplicitAutograd")(cpu_refine_attention)
torch.library.impl("specontext::cpu_rescue_candidates", "CPU")(cpu_rescue_candidates)


@torch.library.register_fake("specontext::cpu_refine_attention")
def _(query, key_cache, value_cache, candidates, length, visible, page_min, page_max, page_shift, gathered_keys,
      gathered_values, budget, sinks, recent, rescue_pages=0, page_tokens=0):
    return query.new_empty(query.shape)


@torch.library.register_fake("specontext::cpu_rescue_candidates")
def _(query, key_cache, candidates, length, visible, page_min, page_max, page_shift, rescue_pages, page_tokens):
    pages = min(rescue_pages, page_min.shape[2]) if rescue_pages else 0
    return candidates.new_empty(*candidates.shape[:2], candidates.shape[2] + pages * page_tokens)
