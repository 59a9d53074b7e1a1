"""The sparse-attention op (``specontext::sparse_attention``): the dense-store shortcut, the
generated Triton kernels, and the torch paths (:func:`.aten_step.sparse_attention` beside its
reference :func:`.sparse_attention.sparse_attention_reference`; for multi-head latent
attention :func:`.mla.mla_sparse_attention`). One op serves both layouts: the site's
:class:`~.spec.AttentionVariant` says which (``nope_dim > 0``: latent)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from . import aten_step, mla
from .sparse_attention import mask_is_causal_only
from .spec import AttentionVariant, StepSpec
from .torch_private import counters

__all__ = ["sparse_attention"]


@torch.library.custom_op("specontext::sparse_attention", mutates_args=())
def sparse_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    indices: torch.Tensor,
    length: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    spec: StepSpec,
    variant: AttentionVariant,
) -> torch.Tensor:
    """Attention over the selected tokens; see
    :func:`~specontext_compile.runtime.sparse_attention.sparse_attention_reference` for shapes
    and :class:`~.spec.AttentionVariant` for ``variant`` (a soft cap and a sliding window are
    the generated kernel's own flags; the dense shortcut is for plain sites only).
    ``length`` counts this step's tokens (the op runs after the layer's ``kv_write``).
    ``spec.kernel``: ``"torch"``, ``"triton"`` or ``"auto"`` (see ``SpeContextConfig.kernel``).

    **Multi-head latent attention** (``variant.nope_dim > 0``): ``query`` is the absorbed
    query ``[batch, num_heads, q_len, r + p]`` (:func:`~.mla.latent_query`), ``key_cache``
    and ``value_cache`` are the layer's latent and rotary key stores ``[batch, 1, capacity,
    r]`` and ``[batch, 1, capacity, p]``, and the result is the attended latent rows
    ``[batch, num_heads, q_len, r]`` before the up-projection (:func:`~.mla.up_project`, which
    the pass puts after it); the kernel is the generated MLA kernel
    (:func:`~specontext_compile.codegen.sparse_mla_decode_attention`); counter
    ``mla_attention_calls``. No dense shortcut: the torch path is
    :func:`~.mla.mla_sparse_attention`.

    ``spec.dense_shortcut``: the caller promises that a selection with a slot for every store
    position holds every written position (true of the selection nodes' outputs); such a
    step (a static fact: budget >= capacity) then runs dense SDPA over the store instead of
    gathering (counter ``dense_prefix_calls``). The pass keeps it on unless the option
    ``dense_shortcut`` is off (tests use that to run the gather path at full budget).
    A site with the fidelity guard or learned sink logits never takes the kernel: the pass
    calls its torch step function directly instead of this op
    (:func:`~specontext_compile.runtime.aten_step.guarded_attention`,
    :func:`~specontext_compile.runtime.aten_step.sinks_attention`,
    :func:`~specontext_compile.runtime.mla.attend_latent`), so the op carries only what its
    kernel reads. The torch paths read nothing on the host; the Triton path on a masked step
    checks the mask once per step (one host sync)."""
    if variant.nope_dim:
        return _latent_attention(query, key_cache, value_cache, indices, length, attn_mask, spec, variant)
    counters["specontext"]["sparse_attention_calls"] += 1
    plain = variant.plain
    if plain and spec.dense_shortcut and aten_step.covers_store(indices, key_cache):
        counters["specontext"]["dense_prefix_calls"] += 1
    elif _use_triton(spec.kernel, query) and _mask_allows_selection(attn_mask, indices, length, query.shape[2]):
        from ..codegen import sparse_decode_attention

        counters["specontext"]["triton_attention_calls"] += 1
        return sparse_decode_attention(
            query, key_cache, value_cache, indices, length, scale=variant.scale, soft_cap=variant.soft_cap,
            sliding_window=variant.sliding_window or None, check_indices=False
        )
    else:
        counters["specontext"]["gather_attention_calls"] += 1
    return aten_step.sparse_attention(query, key_cache, value_cache, indices, length, attn_mask, spec, variant)


def _latent_attention(latent_q: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                      indices: torch.Tensor, length: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      spec: StepSpec, variant: AttentionVariant) -> torch.Tensor:
    """The op at a multi-head latent attention site (arguments as the op's)."""
    counters["specontext"]["mla_attention_calls"] += 1
    if _use_triton(spec.kernel, latent_q) and _mask_allows_selection(attn_mask, indices, length, latent_q.shape[2]):
        from ..codegen import sparse_mla_decode_attention

        counters["specontext"]["triton_attention_calls"] += 1
        r = latent_cache.shape[-1]
        return sparse_mla_decode_attention(latent_q[..., :r], latent_q[..., r:], latent_cache, rope_cache,
                                           indices, length, scale=variant.scale, check_indices=False)
    counters["specontext"]["gather_attention_calls"] += 1
    return mla.mla_sparse_attention(latent_q, latent_cache, rope_cache, indices, length, attn_mask, spec, variant)


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
def _(query, key_cache, value_cache, indices, length, attn_mask, spec, variant):
    b, h, q_len, _ = query.shape
    width = key_cache.shape[-1] if variant.nope_dim else value_cache.shape[-1]  # latent rows: r wide
    return query.new_empty((b, h, q_len, width))
