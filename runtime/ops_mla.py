"""MLA ops (``specontext::``): the absorbed query and attention over selected latent rows.
Bodies and the absorb-vs-up-project choice: :mod:`.mla`."""

from __future__ import annotations

from typing import Optional

import torch
from torch._dynamo.utils import counters

from . import mla
from .ops_attention import _mask_allows_selection, _use_triton
from .spec import AttentionVariant, StepSpec

__all__ = ["mla_sparse_attention"]


@torch.library.custom_op("specontext::mla_sparse_attention", mutates_args=())
def mla_sparse_attention(latent_q: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                         indices: torch.Tensor, length: torch.Tensor, attn_mask: Optional[torch.Tensor],
                         spec: StepSpec, variant: AttentionVariant) -> torch.Tensor:
    """MLA attention over the selected latent rows, before the up-projection (the pass puts
    :func:`~specontext_compile.runtime.mla.up_project` after it): see
    :func:`~specontext_compile.runtime.mla.mla_sparse_attention` for shapes. ``spec.kernel``
    ``"triton"``/``"auto"`` runs the generated MLA kernel
    (:func:`~specontext_compile.codegen.sparse_mla_decode_attention`) when the mask hides
    nothing the causal limit allows; counters ``mla_attention_calls`` and
    ``gather_attention_calls`` or ``triton_attention_calls``. A site with the fidelity guard or
    learned sinks calls :func:`~specontext_compile.runtime.mla.attend_latent` instead (no
    kernel serves it)."""
    counters["specontext"]["mla_attention_calls"] += 1
    if _use_triton(spec.kernel, latent_q) and _mask_allows_selection(attn_mask, indices, length, latent_q.shape[2]):
        from ..codegen import sparse_mla_decode_attention

        counters["specontext"]["triton_attention_calls"] += 1
        r = latent_cache.shape[-1]
        return sparse_mla_decode_attention(latent_q[..., :r], latent_q[..., r:], latent_cache, rope_cache,
                                           indices, length, scale=variant.scale, check_indices=False)
    counters["specontext"]["gather_attention_calls"] += 1
    return mla.mla_sparse_attention(latent_q, latent_cache, rope_cache, indices, length, attn_mask, spec, variant)


@mla_sparse_attention.register_fake
def _(latent_q, latent_cache, rope_cache, indices, length, attn_mask, spec, variant):
    b, h, q_len, _ = latent_q.shape
    return latent_q.new_empty((b, h, q_len, latent_cache.shape[-1]))
