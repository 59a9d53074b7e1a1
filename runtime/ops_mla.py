"""MLA ops (``specontext::``): the absorbed query and attention over selected latent rows.
Bodies and the absorb-vs-up-project choice: :mod:`.mla`."""

from __future__ import annotations

from typing import Optional

import torch
from torch._dynamo.utils import counters

from . import mla
from .ops_attention import _mask_allows_selection, _use_triton
from .probe import active_probe, selection_recall
from .spec import AttentionVariant, StepSpec

__all__ = ["mla_sparse_attention"]


@torch.library.custom_op("specontext::mla_sparse_attention", mutates_args=())
def mla_sparse_attention(latent_q: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                         weight: torch.Tensor, indices: torch.Tensor, length: torch.Tensor,
                         attn_mask: Optional[torch.Tensor], spec: StepSpec, variant: AttentionVariant,
                         dense: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MLA attention over the selected latent rows: see
    :func:`~specontext_compile.runtime.mla.mla_sparse_attention` for shapes and ``variant``
    (scale, ``nope_dim``). ``spec.kernel``
    ``"triton"``/``"auto"`` runs the generated MLA kernel
    (:func:`~specontext_compile.codegen.sparse_mla_decode_attention`) when the mask hides
    nothing the causal limit allows and no guard or sinks are set; counters ``mla_attention_calls``
    and ``gather_attention_calls`` or ``triton_attention_calls``."""
    counters["specontext"]["mla_attention_calls"] += 1
    probe = active_probe()
    if probe is not None:
        keys = torch.cat([latent_cache, rope_cache], dim=-1)
        probe.values.append(1.0 if dense is not None and bool(dense) else
                            selection_recall(latent_q, keys, indices, int(length), variant.scale, attn_mask, None, 0))
    if dense is not None:
        counters["specontext"]["guarded_attention_calls"] += 1
    elif sinks is None and _use_triton(spec.kernel, latent_q) and _mask_allows_selection(attn_mask, indices, length, latent_q.shape[2]):
        from ..codegen import sparse_mla_decode_attention

        counters["specontext"]["triton_attention_calls"] += 1
        r = latent_cache.shape[-1]
        out_latent = sparse_mla_decode_attention(latent_q[..., :r], latent_q[..., r:], latent_cache, rope_cache,
                                                 indices, length, scale=variant.scale, check_indices=False)
        return mla.up_project(out_latent, weight, variant.nope_dim)
    else:
        counters["specontext"]["gather_attention_calls"] += 1
    return mla.mla_sparse_attention(latent_q, latent_cache, rope_cache, weight, indices, length, attn_mask, spec,
                                    variant, dense, sinks)


@mla_sparse_attention.register_fake
def _(latent_q, latent_cache, rope_cache, weight, indices, length, attn_mask, spec, variant, dense=None, sinks=None):
    b, h, q_len, _ = latent_q.shape
    value_dim = weight.shape[0] // h - variant.nope_dim
    return latent_q.new_empty((b, h, q_len, value_dim))
