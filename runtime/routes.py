"""Which attention a rewritten site runs: decided once, by the pass, from static facts (issue 53, item 1).

The rewrite pass (``passes/sparse_rewrite.py``) calls :func:`decide` once per decode site of
``specontext::sparse_attention`` with the site's example values (fake or real tensors: only
devices, dtypes and shapes are read) and stores the answer as the site's ``StepSpec.route``
(:data:`~.spec.ROUTES`). Everything after reads it and never decides again:

- the op (:mod:`.ops_attention`) dispatches on it (eager op chain, ``lower=False``);
- its aten body (:func:`.aten_step.sparse_attention`) runs ``"dense"`` over the store and
  ``"gather"`` over the selection;
- the lowering (``passes/lower.py``) swaps the op for the body the route names (on CUDA
  graphs ``"kernel"`` for :func:`.kernel_step.kernel_attention`);
- the kernel wrapper (:func:`.kernel_step.kernel_attention`) is the one route to the generated
  kernel, eager or compiled;
- the offload schedule (``passes/schedule.py``) moves the ``"offload"`` sites, and only
  those, to :func:`.offload_step.attention` (rows read through the offload manager).

Within its route, whether our C++ CPU kernel computes a site is decided by the pass too, once,
here (:func:`cpu_kernel`; the selection node's :func:`selection_kernel`), and stored as
``StepSpec.cpu_kernel``: :func:`.aten_step.refine_and_attend` (and its offloaded twin),
the dense body and the lagged-query scorer read that flag and ask nothing else.

Sites the op does not serve are decided by the pass too, by the function it calls: the
fidelity guard's :func:`.aten_step.guarded_attention`, learned sinks'
:func:`.aten_step.sinks_attention`, MLA with either of those :func:`.mla.attend_latent`.

Invariants:

- **Static only.** No device value is read, so the decision costs nothing per step and the
  compiled step has no host sync for it.
- **Offload first.** With KV offload (``StepSpec.offload``) every non-MLA site takes
  ``"offload"``: its store may be in host memory, so it gathers the selected rows (MLA layers
  stay resident and are decided as without offload).
- **Exact or not taken.** ``"dense"`` needs a selection with a slot for every store position
  (it then holds every written one); ``"kernel"`` needs a site the kernel serves exactly
  (:func:`.kernel_step.kernel_reason`: a mask only when it folds into the selection). Any
  other site gathers.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .spec import AttentionVariant, StepSpec

__all__ = ["Decision", "cpu_kernel", "decide", "kernel_allowed", "selection_kernel"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One site's route (:data:`~.spec.ROUTES`) and why the faster ones were not taken (None
    when nothing was passed over)."""

    route: str
    reason: str | None = None


def kernel_allowed(kernel: str, query: torch.Tensor) -> str | None:
    """Why option ``kernel`` keeps a site on ``query``'s device off the generated kernel, or
    None when it allows it: ``"torch"`` never; ``"auto"`` on CUDA with Triton importable;
    ``"triton"`` anywhere Triton runs.

    Raises:
        RuntimeError: ``kernel="triton"`` on CPU tensors without ``TRITON_INTERPRET=1``
            (Triton's interpreter), naming the two options that run here.
    """
    if kernel == "torch":
        return "kernel='torch'"
    from ..codegen import interpreter_enabled, triton_available

    if kernel == "auto":
        return None if query.is_cuda and triton_available() else "kernel='auto' off CUDA"
    if query.device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError(
            "specontext kernel='triton' on CPU tensors needs TRITON_INTERPRET=1 (Triton's "
            "interpreter); use kernel='torch' or 'auto' for real CPU runs"
        )
    return None


def decide(query: torch.Tensor, key_cache: torch.Tensor, attn_mask: torch.Tensor | None, covers: bool,
           spec: StepSpec, variant: AttentionVariant) -> Decision:
    """The route of one ``specontext::sparse_attention`` site.

    Args:
        query: the site's query ``[batch, num_heads, q_len, head_dim]`` (MLA: the absorbed
            query), a fake or real tensor.
        key_cache: its key store ``[batch, num_kv_heads, capacity, head_dim]`` (MLA: the latent
            store).
        attn_mask: its mask (example value) or None.
        covers: whether the site's selection has a slot for every store position (a static
            fact the pass reads from shapes: the budget reaches a static capacity).
        spec: the step's options at the site (``offload``, ``dense_shortcut``, ``kernel``).
        variant: the site's :class:`~.spec.AttentionVariant`.

    Returns:
        :class:`Decision`: ``"offload"`` for a non-MLA site with ``spec.offload``; else ``"dense"`` for a plain site whose selection has a slot for every
        store position with option ``dense_shortcut`` on (MLA never); else ``"kernel"``
        where option ``kernel`` allows it (an MLA site: ``kernel="triton"`` only) and the
        kernel serves the site exactly; else ``"gather"``.

    Raises:
        RuntimeError: as :func:`kernel_allowed`.
    """
    latent = variant.nope_dim > 0
    if spec.offload and not latent:
        return Decision("offload", "KV offload: the store may be in host memory (its selected rows are read)")
    if not latent and spec.dense_shortcut and variant.plain and covers:
        return Decision("dense")
    reason = kernel_allowed(spec.kernel, query)
    if reason is None and latent and spec.kernel != "triton":
        reason = ("the MLA kernel is taken with kernel='triton' only (inductor's kernels otherwise, until a "
                  "device run times the two)")
    if reason is None:
        from .kernel_step import kernel_reason, latent_kernel_reason

        reason = (latent_kernel_reason if latent else kernel_reason)(query, key_cache, attn_mask)
    return Decision("gather", reason) if reason is not None else Decision("kernel")


def _few_rows(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """A few decode rows per KV head on CPU tensors (:func:`.sparse_attention.fused_products`
    of a compiled step): the rows our CPU kernels are written for."""
    from .sparse_attention import fused_products

    b, _, _, head_dim = query.shape
    return fused_products(query.reshape(b, key_cache.shape[1], -1, head_dim), key_cache, True)


def cpu_kernel(query: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor], attn_mask: torch.Tensor | None,
               spec: StepSpec, variant: AttentionVariant, *, dense: bool, slots: int | None,
               pages: tuple = ()) -> bool:
    """Whether our C++ CPU kernel computes one site (``StepSpec.cpu_kernel``), decided once by
    the pass from the site's example values (fake or real: devices, dtypes, shapes and
    ``requires_grad`` are read).

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``.
        store: the layer's ``(key_cache, value_cache)``, each ``[batch, num_kv_heads,
            capacity, head_dim]`` (MLA's latent pair: never a CPU kernel's).
        attn_mask: the mask the site's attention reads (example value) or None.
        spec: the site's spec (``compiled``, ``rescue_pages`` read).
        variant: the site's :class:`~.spec.AttentionVariant`.
        dense: the site attends over the whole store (route ``"dense"``):
            :func:`.cpu_kernels.cpu_decode_attention` where :func:`.cpu_kernels.applies`.
        slots: for a refined site lowered as one refinement-and-attention body, the
            candidates it ranks per KV head; :func:`.cpu_refine.cpu_refine_attention` where
            :func:`.cpu_refine.applies`. None: the site does not refine (or is guarded).
        pages: the store's page bounds ``(page_min, page_max, page_shift)`` (example values)
            when the site rescues pages, else empty.

    Returns:
        True only for a step inductor compiles (``spec.compiled``: an eager step keeps the
        torch bodies), a few decode rows per KV head on CPU, no gradient to carry (the
        kernels have no backward), and a site the kernel serves exactly.
    """
    key_cache, value_cache = store
    if not spec.compiled or isinstance(key_cache, tuple) or key_cache.dim() != 4 or not _few_rows(query, key_cache):
        return False
    if any(t.requires_grad for t in (query, key_cache, value_cache)):
        return False
    from . import cpu_kernels, cpu_refine

    if dense:
        return cpu_kernels.applies(query, key_cache, value_cache, attn_mask)
    if slots is None:
        return False
    rescue = tuple(pages) if spec.rescue_pages > 0 and pages else ()
    return cpu_refine.applies(query, store, slots, attn_mask, variant, rescue)


def selection_kernel(query_state: torch.Tensor, stores: list, spec: StepSpec, position_bias: bool) -> bool:
    """Whether the lagged-query head's scores are our C++ CPU kernel's
    (:func:`.cpu_selection.cpu_selection_scores`; the selection node's
    ``StepSpec.cpu_kernel``), decided once by the pass from example values: a step inductor
    compiles (``spec.compiled``), no ALiBi ``position_bias``, no gradient to carry, and
    recorded queries ``[slots, batch, num_heads, 1, head_dim]`` and key stores the kernel
    serves (:func:`.cpu_selection.applies`)."""
    if not spec.compiled or position_bias or query_state.requires_grad:
        return False
    from . import cpu_selection

    if query_state.device.type == "cpu" and _symbolic(query_state, *stores):
        # once per graph (one selection node): every site of this graph loses our kernels too
        logger.info("specontext: this graph's sizes are symbolic (dynamo made them dynamic, e.g. after a second "
                    "batch size), and our CPU kernels need static sizes: the step runs its torch bodies, "
                    "slower. Compile with torch.compile(..., dynamic=False) to keep the kernels (one graph "
                    "per size)")
    return cpu_selection.applies(query_state, stores)


def _symbolic(*tensors) -> bool:
    """Whether any size of ``tensors`` (tensors; others skipped) is symbolic."""
    return any(not isinstance(n, int) for t in tensors if isinstance(t, torch.Tensor) for n in t.shape)
