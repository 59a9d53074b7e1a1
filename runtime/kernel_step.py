"""The generated Triton kernel inside the compiled decode step (issue 27, item 6).

SpeContext (arXiv 2512.00722), section 4: every layer attends only to the selected tokens.
:func:`kernel_attention` is the one route to the generated kernel, taken by every site whose
``StepSpec.route`` is ``"kernel"`` (:func:`~.routes.decide`, with :func:`kernel_reason` saying
which sites the kernel serves exactly): the op's body calls it on the eager op chain, and on
CUDA graphs the lowered step (``passes/lower.py``) calls it in the op's place. It calls the op
``specontext::generated_attention``, a ``torch.library.triton_op`` whose body launches our
generated split-K kernel (``codegen``) through ``wrap_triton``. Inductor therefore sees the
kernel itself, not an opaque op: it schedules it inside the compiled step, with no Python
dispatch and no host read, and CUDA graphs capture it like its own kernels. On CPU tensors
the op runs the kernel in Triton's interpreter (``TRITON_INTERPRET=1``, tests) or else the
torch reference (:func:`~.sparse_attention.sparse_attention_reference`), the tests' oracle.

Invariants:

- **Exact or not taken.** The kernel applies the causal limit only. A site whose mask could
  hide more is served only when the mask can be folded into the selection exactly (a bool
  mask, one query row, one mask head: a hidden position becomes a ``-1`` padding slot, which
  the kernel skips); any other site keeps the torch body, decided from static facts (shapes,
  dtypes), with the reason in the pass's result (``RewriteResult.routes``).
- **No host read.** Nothing here reads a device value on the host.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true as known
from torch.library import triton_op, wrap_triton

from ..codegen.spec import DTYPE_NAMES, MAX_GROUP, MAX_HEAD_DIM, MAX_Q_LEN
from .sparse_attention import sparse_attention_reference
from .spec import AttentionVariant, StepSpec

__all__ = ["fold_mask", "generated_attention", "kernel_attention", "kernel_reason", "latent_kernel_reason",
           "launch_generated"]


def launch_generated(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     indices: torch.Tensor, length: torch.Tensor, scale: float, soft_cap: Optional[float],
                     sliding_window: int, latent: bool) -> torch.Tensor:
    """Attention of ``query`` over the selected positions only, through the generated
    Triton kernel (:func:`~specontext_compile.codegen.sparse_decode_attention`, or with
    ``latent`` the MLA kernel :func:`~specontext_compile.codegen.sparse_mla_decode_attention`;
    each launched with ``wrap_triton``); on CPU the torch reference.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``, fp32/bf16/fp16, ``q_len <= 16``.
        key_cache: ``[batch, num_kv_heads, capacity, head_dim]``, same dtype, any strides.
        value_cache: ``[batch, num_kv_heads, capacity, head_dim_v]``, same dtype.
        indices: int64 ``[batch, num_kv_heads, budget]``, unique per row, ``-1`` = padding.
        length: int64 ``[]`` or ``[batch]``: tokens written, this step's included (row ``r``
            sees ``p <= length - q_len + r``).
        scale: softmax scale.
        soft_cap: Gemma-2's logit soft cap (``c * tanh(logits / c)``), or None.
        sliding_window: 0, or the window ``W``: row ``r`` sees only ``p > length - q_len + r - W``
            (:class:`~.spec.AttentionVariant`).
        latent: multi-head latent attention: ``query`` is the absorbed query ``[batch,
            num_heads, q_len, r + p]``, ``key_cache`` the latent store ``[batch, 1, capacity,
            r]`` (keys' latent part and values), ``value_cache`` the rotary key store ``[batch, 1,
            capacity, p]`` (:func:`~.mla.mla_sparse_attention`'s layout).

    Returns:
        ``[batch, num_heads, q_len, head_dim_v]`` in ``query.dtype`` (``r`` wide with
        ``latent``); a row with nothing to see is zeros.
    """
    return _generated(query, key_cache, value_cache, indices, length, scale, soft_cap, sliding_window, latent,
                      wrap_triton)


def _generated(query, key_cache, value_cache, indices, length, scale, soft_cap, sliding_window, latent, wrap):
    """The generated kernel's launch (``wrap``: ``wrap_triton`` inside the op, None in the
    interpreter): one place for both layouts."""
    from ..codegen import sparse_decode_attention, sparse_mla_decode_attention

    options = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window or None, check_indices=False,
                   wrap=wrap)
    if latent:
        r = key_cache.shape[-1]
        return sparse_mla_decode_attention(query[..., :r], query[..., r:], key_cache, value_cache, indices, length,
                                           **options)
    return sparse_decode_attention(query, key_cache, value_cache, indices, length, **options)


#: the op: :func:`launch_generated` as a ``triton_op`` (torch.compile traces into its kernels)
generated_attention = triton_op("specontext::generated_attention", mutates_args=())(launch_generated)


@generated_attention.register_kernel("cpu")
def _on_cpu(query, key_cache, value_cache, indices, length, scale, soft_cap, sliding_window, latent):
    """On CPU tensors: the kernel in Triton's interpreter (``TRITON_INTERPRET=1``: option
    ``kernel="triton"``, for tests), else the torch reference (MLA's: the latent store is
    keys' latent part and values)."""
    from ..codegen import interpreter_enabled

    if interpreter_enabled():
        return _generated(query, key_cache, value_cache, indices, length, scale, soft_cap, sliding_window, latent,
                          None)
    if latent:
        keys = torch.cat([key_cache, value_cache], dim=-1)
        return sparse_attention_reference(query, keys, key_cache, indices, length, None,
                                          AttentionVariant(scale, soft_cap, sliding_window))
    return sparse_attention_reference(query, key_cache, value_cache, indices, length, None,
                                      AttentionVariant(scale, soft_cap, sliding_window))


def kernel_reason(query: torch.Tensor, key_cache: torch.Tensor, attn_mask: torch.Tensor | None) -> str | None:
    """Why the generated kernel cannot serve a sparse-attention site exactly, or None when it
    can (:func:`~.routes.decide` asks, once per site, after option ``kernel`` allowed it).

    Reads static facts only (dtypes and shapes of example or fake tensors): ``q_len``,
    ``head_dim`` and the GQA group within the kernel's limits (``codegen.spec``), fp32/bf16/fp16
    tensors of one dtype, and no mask or a bool mask of one head and one query row (folded
    into the selection). A soft cap and a sliding window are the kernel's own
    ``tl.constexpr`` flags; sites with learned sinks or a position bias never reach the op."""
    width = (known(query.shape[-1] <= MAX_HEAD_DIM) and known(query.shape[1] <= MAX_GROUP * key_cache.shape[1]),
             f"head_dim or group past the kernel's ({MAX_HEAD_DIM}, {MAX_GROUP})")
    return _first_failed(query, key_cache, attn_mask, width)


def latent_kernel_reason(query: torch.Tensor, latent_cache: torch.Tensor, attn_mask: torch.Tensor | None
                         ) -> str | None:
    """:func:`kernel_reason` of a multi-head latent attention site (absorbed ``query``
    ``[batch, num_heads, q_len, r + p]``, ``latent_cache`` ``[batch, 1, capacity, r]``) for the
    generated MLA kernel: ``q_len`` within its limit, a dtype it takes, a foldable mask."""
    return _first_failed(query, latent_cache, attn_mask)


def _first_failed(query: torch.Tensor, keys: torch.Tensor, attn_mask: torch.Tensor | None, *extra) -> str | None:
    """The reason of the first failed check: query rows, dtypes, ``extra`` ``(ok, reason)``
    pairs, the mask."""
    checks = (
        (known(query.shape[2] <= MAX_Q_LEN), f"{query.shape[2]} query rows (the kernel takes <= {MAX_Q_LEN})"),
        (query.dtype in DTYPE_NAMES.values() and keys.dtype == query.dtype, f"dtype {query.dtype}/{keys.dtype}"),
        *extra,
        (attn_mask is None or _foldable(attn_mask, query.shape[2]), "a mask the kernel cannot apply"),
    )
    return next((reason for ok, reason in checks if not ok), None)


def _foldable(attn_mask: torch.Tensor, q_len: int) -> bool:
    return attn_mask.dtype == torch.bool and q_len == 1 and attn_mask.dim() == 4 and attn_mask.shape[1] == 1


def fold_mask(indices: torch.Tensor, attn_mask: torch.Tensor | None, capacity: int, q_len: int = 1) -> torch.Tensor:
    """The selection ``[batch, num_kv_heads, budget]`` with each position a foldable bool mask
    ``[batch|1, 1, 1, >= capacity]`` hides set to ``-1`` (padding, which the kernels skip): the
    mask applied exactly, on the device, with no host read.

    Raises:
        ValueError: a mask the kernel route cannot apply exactly (not bool, several heads or
            query rows, narrower than the store's ``capacity``): only a spec built by hand
            gets here, the pass routes such sites to the gather path.
    """
    if attn_mask is None:
        return indices
    if not (_foldable(attn_mask, q_len) and known(attn_mask.shape[-1] >= capacity)):
        raise ValueError(f"StepSpec.route='kernel' takes no mask or a bool mask [batch|1, 1, 1, >= {capacity}] with "
                         f"one query row, got {attn_mask.dtype} {tuple(attn_mask.shape)} for {q_len} row(s); "
                         "use route='gather'")
    b, num_kv, budget = indices.shape
    visible = attn_mask[:, 0, 0, :].expand(b, attn_mask.shape[-1]).gather(
        1, indices.clamp(min=0).reshape(b, num_kv * budget)).view(b, num_kv, budget)
    return torch.where(visible, indices, -1)


def kernel_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     indices: torch.Tensor, length: torch.Tensor, attn_mask: torch.Tensor | None,
                     spec: StepSpec, variant: AttentionVariant) -> torch.Tensor:
    """:func:`~.aten_step.sparse_attention`'s arguments and result, through
    :func:`generated_attention`: the one route to the generated kernel, for a site whose
    ``spec.route`` is ``"kernel"`` (the op's body on that route, and the lowering's target on
    CUDA graphs), both layouts (``variant.nope_dim > 0``: multi-head latent attention, the
    operands as :func:`~.ops_attention.sparse_attention`'s). A bool mask ``[batch|1, 1, 1, capacity]`` is folded into the selection
    (:func:`fold_mask`, which refuses any other mask); no host read."""
    indices = fold_mask(indices, attn_mask, key_cache.shape[-2], query.shape[2])
    return generated_attention(query, key_cache, value_cache, indices, length, variant.scale,
                               variant.soft_cap, variant.sliding_window, variant.nope_dim > 0)
