"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a selection of the latent KV cache.

An MLA layer caches, per token, one latent row ``c`` (``kv_lora_rank`` wide, after its norm)
and one rotary key row ``k_rot`` (``qk_rope_head_dim`` wide) shared by every head; Hugging
Face up-projects the *whole* cache every step (``kv_b_proj``: ``W = [W_UK; W_UV]`` per head)
into per-head keys ``[W_UK c ; k_rot]`` and values ``W_UV c``. Selection needs no
up-projection at all:

* **score** ``q . k = q_nope . (W_UK c) + q_rot . k_rot = (W_UK^T q_nope) . c + q_rot . k_rot``:
  with the *absorbed* query ``[W_UK^T q_nope ; q_rot]`` (``kv_lora_rank + rope`` wide) the
  layer is multi-query attention over the latent rows ``[c ; k_rot]`` (one KV head);
* **output** ``sum_t p_t W_UV c_t = W_UV (sum_t p_t c_t)``: attend to the latent rows, then
  up-project the one attended row per head.

So the retrieval head scores the latent cache directly (the paper's head-level scores over
the compressed KV, SpeContext section 4 / its MLA mapping), and the sparse step gathers only
the selected ``[c ; k_rot]`` rows. The rotary part needs no special case: ``k_rot`` is
cached after its rotation, so the selected rows carry their own positions.

Absorb vs up-project, bytes per layer and decode step with budget ``B``, ``H`` heads, latent
``r``, rope ``p``, nope ``n``, value ``v`` (DeepSeek-V3: 128, 512, 64, 128, 128): both read
the ``B (r + p)`` latent rows and ``W`` once; up-projecting the selection also writes and
reads ``B H (n + p + v)`` per-head key/value entries (``B = 2048``: 2048 * 128 * 320 * 2
bytes = 168 MB in bf16, vs 2.4 MB of latent rows) and spends ``B H (n + v) r`` MACs
(34 G) against ``H (n + v) r + B H (2r + p)`` (0.3 G) absorbed. We absorb, as MLA decode
kernels do; the generated Triton kernel for this layout is
:func:`~specontext_compile.codegen.sparse_mla_decode_attention`.
"""

from __future__ import annotations

import torch

from .aten_step import optional_operands
from .sparse_attention import _gather_tokens, attend_gathered
from .spec import AttentionVariant, StepSpec

__all__ = ["attend_latent", "latent_query", "mla_sparse_attention", "split_kv_b_weight", "up_project"]


def split_kv_b_weight(weight: torch.Tensor, num_heads: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK [heads, nope_dim, r], W_UV [heads, value_dim, r])`` views of Hugging Face's
    ``kv_b_proj.weight`` ``[heads * (nope_dim + value_dim), r]`` (rows per head: nope then value)."""
    r = weight.shape[-1]
    per_head = weight.view(num_heads, -1, r)
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def latent_query(query: torch.Tensor, weight: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """The absorbed query ``[W_UK^T q_nope ; q_rot]`` (called directly by the rewritten graph).

    Args:
        query: ``[batch, num_heads, q_len, nope_dim + rope_dim]`` (Hugging Face's
            ``cat(q_pass, q_rot)``, rotary part last).
        weight: ``kv_b_proj.weight`` ``[num_heads * (nope_dim + value_dim), kv_lora_rank]``.
        nope_dim: ``qk_nope_head_dim``.

    Returns:
        ``[batch, num_heads, q_len, kv_lora_rank + rope_dim]`` in ``query.dtype`` (the
        product is formed in float32: no half-precision overflow).
    """
    w_uk, _ = split_kv_b_weight(weight, query.shape[1], nope_dim)
    absorbed = torch.einsum("bhqn,hnr->bhqr", query[..., :nope_dim].float(), w_uk.float())
    return torch.cat([absorbed.to(query.dtype), query[..., nope_dim:]], dim=-1)


def gather_latent_keys(latent_cache: torch.Tensor, rope_cache: torch.Tensor, indices: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys [b, 1, k, r + p], latent rows [b, 1, k, r])`` of the positions ``indices``
    ``[b, 1, k]`` (``-1`` padding reads position 0; the caller masks it)."""
    safe = indices.clamp(min=0)
    latent = _gather_tokens(latent_cache, safe)
    return torch.cat([latent, _gather_tokens(rope_cache, safe)], dim=-1), latent


def mla_sparse_attention(latent_q: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                         indices: torch.Tensor, length: torch.Tensor, attn_mask: torch.Tensor | None,
                         spec: StepSpec, variant: AttentionVariant) -> torch.Tensor:
    """MLA attention of one layer over the selected latent rows (the torch path of
    ``specontext::sparse_attention`` at an MLA site, ``variant.nope_dim > 0``), before the
    up-projection (:func:`up_project`, which the pass puts after it).

    Args:
        latent_q: ``[batch, num_heads, q_len, r + p]`` from :func:`latent_query`.
        latent_cache: ``[batch, 1, capacity, r]``; rope_cache: ``[batch, 1, capacity, p]``
            (the layer's two stores; positions ``>= length`` may hold garbage).
        indices: int64 ``[batch, 1, k]`` positions (``-1`` padding), from a selection node.
        length: int64 scalar, tokens written including this step's.
        attn_mask: Hugging Face mask ``[batch|1, 1|heads, q_len, >= capacity]`` or None.
        spec: the step's :class:`~.spec.StepSpec` (only ``kernel`` matters, to the op).
        variant: the site's :class:`~.spec.AttentionVariant`: ``scale`` (of the ``nope + rope``
            wide head).

    Returns:
        attended latent rows ``[batch, num_heads, q_len, r]`` in ``latent_q.dtype``: after
        :func:`up_project`, exactly (up to float rounding) Hugging Face's attention restricted
        to the selected positions.
    """
    return attend_latent(latent_q, (latent_cache, rope_cache), indices, length, attn_mask, variant)


def attend_latent(latent_q: torch.Tensor, stores: tuple[torch.Tensor, torch.Tensor], indices: torch.Tensor,
                  length: torch.Tensor, attn_mask: torch.Tensor | None, variant: AttentionVariant,
                  dense: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attended latent rows ``[batch, num_heads, q_len, r]`` over the selected positions of the
    layer's ``stores = (latent_cache, rope_cache)`` (arguments as :func:`mla_sparse_attention`'s).
    The pass calls it directly for a site no kernel serves: ``dense``, the fidelity guard's
    bool scalar (None = off; True attends to every slot, through ``torch.cond``); ``sinks``,
    learned sink logits per head ``[num_heads]`` (HY-V4) or None: one more softmax column per
    head that takes mass and adds no value."""
    latent_cache, rope_cache = stores
    plain = AttentionVariant(scale=variant.scale, fused_products=variant.fused_products)  # no soft cap, no window
    if dense is None:
        return _attend(latent_q, latent_cache, rope_cache, indices, length, attn_mask, sinks, plain)
    capacity = latent_cache.shape[-2]
    every = torch.arange(capacity, device=indices.device).expand(indices.shape[0], indices.shape[1], capacity)
    extra, unpack = optional_operands(attn_mask, sinks)
    tensors = (latent_q, latent_cache, rope_cache, indices, length, *extra)
    return torch.cond(
        dense, lambda q, c, r, i, n, *rest: _attend(q, c, r, every, n, *unpack(rest), plain),
        lambda q, c, r, i, n, *rest: _attend(q, c, r, i, n, *unpack(rest), plain), tensors)


def _attend(latent_q, latent_cache, rope_cache, indices, length, attn_mask, sinks, variant):
    """Attended latent rows ``[b, h, q, r]`` over the selected positions."""
    keys, latent = gather_latent_keys(latent_cache, rope_cache, indices)
    return attend_gathered(latent_q, keys, latent, indices, length, attn_mask, variant, sinks=sinks)


def up_project(out_latent: torch.Tensor, weight: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """``W_UV`` applied per head to attended latent rows ``[batch, heads, q_len, r]`` ->
    ``[batch, heads, q_len, value_dim]`` (float32 accumulation, result in the input dtype)."""
    _, w_uv = split_kv_b_weight(weight, out_latent.shape[1], nope_dim)
    return torch.einsum("bhqr,hvr->bhqv", out_latent.float(), w_uv.float()).to(out_latent.dtype)
