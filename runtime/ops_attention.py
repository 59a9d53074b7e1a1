"""The sparse-attention op (``specontext::sparse_attention``): the dense-store shortcut, the
generated Triton kernels, and the torch paths (:func:`.aten_step.sparse_attention` beside its
reference :func:`.sparse_attention.sparse_attention_reference`; for multi-head latent
attention :func:`.mla.mla_sparse_attention`). One op serves both layouts: the site's
:class:`~.spec.AttentionVariant` says which (``nope_dim > 0``: latent)."""

from __future__ import annotations

from typing import Optional

import torch

from . import aten_step, kernel_step, mla
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

    **Multi-head latent attention** (``variant.nope_dim > 0``): ``query`` is the absorbed
    query ``[batch, num_heads, q_len, r + p]`` (:func:`~.mla.latent_query`), ``key_cache``
    and ``value_cache`` are the layer's latent and rotary key stores ``[batch, 1, capacity,
    r]`` and ``[batch, 1, capacity, p]``, and the result is the attended latent rows
    ``[batch, num_heads, q_len, r]`` before the up-projection (:func:`~.mla.up_project`, which
    the pass puts after it); the kernel is the generated MLA kernel
    (:func:`~specontext_compile.codegen.sparse_mla_decode_attention`), reached as the plain
    layout's is (:func:`~.kernel_step.kernel_attention`); counter
    ``mla_attention_calls``. No dense shortcut: the torch path is
    :func:`~.mla.mla_sparse_attention`.

    ``spec.route`` (:data:`~.spec.ROUTES`), decided once per site by the pass
    (:func:`~.routes.decide`) and only read here: ``"dense"`` attends over the whole store
    (the selection covers it; counter ``dense_prefix_calls``), ``"kernel"`` runs the generated
    kernel through :func:`~.kernel_step.kernel_attention` (MLA: the generated MLA kernel), a
    foldable mask folded into the selection (counter ``triton_attention_calls``), and
    ``"gather"`` the torch body over the selected positions (``gather_attention_calls``), as
    does ``"offload"`` where the offload schedule did not move the site.
    A site with the fidelity guard or learned sink logits never reaches this op: the pass
    calls its torch step function directly instead
    (:func:`~specontext_compile.runtime.aten_step.guarded_attention`,
    :func:`~specontext_compile.runtime.aten_step.sinks_attention`,
    :func:`~specontext_compile.runtime.mla.attend_latent`), so the op carries only what its
    kernel reads. Nothing here reads a device value on the host."""
    if variant.nope_dim:
        return _latent_attention(query, key_cache, value_cache, indices, length, attn_mask, spec, variant)
    counters["specontext"]["sparse_attention_calls"] += 1
    counters["specontext"][_COUNTERS[spec.route]] += 1
    if spec.route == "kernel":
        return kernel_step.kernel_attention(query, key_cache, value_cache, indices, length, attn_mask, spec, variant)
    return aten_step.sparse_attention(query, key_cache, value_cache, indices, length, attn_mask, spec, variant)


_COUNTERS = {"dense": "dense_prefix_calls", "kernel": "triton_attention_calls", "gather": "gather_attention_calls",
             "offload": "gather_attention_calls"}


def _latent_attention(latent_q: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                      indices: torch.Tensor, length: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      spec: StepSpec, variant: AttentionVariant) -> torch.Tensor:
    """The op at a multi-head latent attention site (arguments as the op's)."""
    if spec.route == "dense":
        raise ValueError("StepSpec.route='dense' is not built for multi-head latent attention (the latent "
                         "store is read through the selection); use route='gather' or 'kernel'")
    counters["specontext"]["mla_attention_calls"] += 1
    counters["specontext"][_COUNTERS[spec.route]] += 1
    if spec.route == "kernel":
        return kernel_step.kernel_attention(latent_q, latent_cache, rope_cache, indices, length, attn_mask, spec,
                                            variant)
    return mla.mla_sparse_attention(latent_q, latent_cache, rope_cache, indices, length, attn_mask, spec, variant)


@sparse_attention.register_fake
def _(query, key_cache, value_cache, indices, length, attn_mask, spec, variant):
    b, h, q_len, _ = query.shape
    width = key_cache.shape[-1] if variant.nope_dim else value_cache.shape[-1]  # latent rows: r wide
    return query.new_empty((b, h, q_len, width))
