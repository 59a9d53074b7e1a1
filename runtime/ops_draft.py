"""Draft-head ops (``specontext::``, option ``retrieval_head``): its anchor and its step (Q/K of
the step's tokens into its own key cache: a loaded module, opaque to the compiler). The
recorded hidden states of fused heads and the selection node are direct calls of
:func:`.aten_step.record_hidden` and :func:`.scorers.head_select`. Reference helpers:
:mod:`.draft_retrieval`."""

from __future__ import annotations

import torch

from . import draft_retrieval
from .ops_store import CacheCapacityError

__all__ = ["draft_anchor", "draft_step"]


@torch.library.custom_op("specontext::draft_anchor",
                         mutates_args=("draft_keys", "draft_length", "aux_state", "aux_valid"))
def draft_anchor(draft_keys: torch.Tensor, draft_length: torch.Tensor, aux_state: torch.Tensor,
                 aux_valid: torch.Tensor, head: str) -> None:
    """No-op in eager mode. Puts the draft head's state into the traced graph at the start
    of layer 0, right after ``retrieval_anchor``: its key cache (``draft_keys``
    ``[batch, head_kv_heads, capacity, head_dim]``, ``draft_length`` int64 scalar) and the
    recorded auxiliary hidden states of the last positions (``aux_state`` ``[batch,
    1 + ROLLBACK_TOKENS, aux_width]``, ``aux_valid`` int64 ``[1 + ROLLBACK_TOKENS]`` stamps:
    :meth:`.draft_retrieval.DraftKeyCache.prepare`). ``head`` is the head's resolved folder (a graph constant the pass checks
    against ``retrieval_head``)."""
    return

@draft_anchor.register_fake
def _(draft_keys, draft_length, aux_state, aux_valid, head) -> None:
    return None

@torch.library.custom_op("specontext::draft_step", mutates_args=("draft_keys", "draft_length"))
def draft_step(
    draft_keys: torch.Tensor,
    draft_length: torch.Tensor,
    length: torch.Tensor,
    input_ids: torch.Tensor,
    embedding: torch.Tensor,
    head: str,
    aux: list[torch.Tensor],
    after_write: bool,
) -> torch.Tensor:
    """The draft head on this step's tokens (SpeContext section 4).

    Runs :class:`~specontext_compile.runtime.eagle3.Eagle3RetrievalHead` (loaded from the
    folder ``head``, see :func:`~specontext_compile.runtime.draft_retrieval.load_head`) on
    ``input_ids`` (int64 ``[batch, q_len]``) at the cache positions ``start .. start+q_len-1``
    and writes its K into ``draft_keys`` ``[batch, head_kv_heads, capacity, head_dim]`` there.
    ``start`` is ``length`` (the target's layer-0 written tokens, int64 scalar), minus
    ``q_len`` when ``after_write`` (the op then runs after layer 0's ``kv_write``).
    ``draft_length`` advances to ``start + q_len`` only when it was ``start`` (every earlier
    position has its K); otherwise it stays behind and selections fall back to recency
    (never scored from unwritten slots). ``embedding``: the target's ``[vocab, hidden]``
    token embedding, used when the head has none.

    Auxiliary hidden states ``aux``: ``[]`` = zeros (embedding-only head). Fused:
    ``[aux_state, aux_valid, *hidden]``; token ``i`` of the step gets the previous token's:
    the entry of position ``start - 1`` in ``aux_state`` for the first
    (:func:`.draft_retrieval.previous_hidden`: zeros unless recorded for that very position), and for
    the others the concatenation of ``hidden`` (this step's outputs ``[batch, q_len,
    target_hidden]`` of the auxiliary layers) at row ``i - 1``; steps of more than one token
    need ``hidden``.

    Returns:
        ``[batch, head_heads, 1, head_dim]`` (``draft_keys``' dtype): the head's query of the
        step's last token (prefill graphs ignore it).

    Raises:
        CacheCapacityError: (CPU) when the write would pass ``capacity``.
        ValueError: a fused step of several tokens without ``hidden``.
    """
    b, q_len = input_ids.shape
    capacity = draft_keys.shape[-2]
    device, dtype = draft_keys.device, draft_keys.dtype
    module = draft_retrieval.load_head(head, embedding, dtype, device)
    start = length.to(device) - (q_len if after_write else 0)
    positions = (start + torch.arange(q_len, device=device)).expand(b, q_len)
    width = module.fc.shape[1]
    if not aux:
        aux = torch.zeros((b, q_len, width), dtype=dtype, device=device)
    else:
        aux_state, aux_valid, *hidden = aux
        prev = draft_retrieval.previous_hidden(aux_state, aux_valid, start).to(dtype)
        if q_len > 1:
            if not hidden:
                raise ValueError("a fused draft head needs this step's hidden states for a step of "
                                 f"{q_len} tokens")
            aux = torch.cat([prev, torch.cat(hidden, -1)[:, :-1].to(dtype)], 1)
        else:
            aux = prev
    query, key = module(input_ids.to(device), aux, positions)
    if device.type == "cpu":
        cached = int(start)
        if cached + q_len > capacity:
            raise CacheCapacityError(
                f"draft head key cache is full: {cached} + {q_len} tokens > capacity {capacity}. "
                "Create the SpeContextCache with a larger max_cache_len.")
        draft_keys[:, :, cached : cached + q_len].copy_(key)
    else:
        draft_keys.index_copy_(2, positions[0], key.to(dtype))
    in_step = (draft_length == start).to(draft_length.dtype)
    draft_length.copy_(in_step * (start + q_len) + (1 - in_step) * draft_length)
    return query[:, :, -1:, :].contiguous()

@draft_step.register_fake
def _(draft_keys, draft_length, length, input_ids, embedding, head, aux, after_write):
    spec = draft_retrieval.head_spec(head)
    return draft_keys.new_empty((input_ids.shape[0], spec.num_heads, 1, spec.head_dim))
