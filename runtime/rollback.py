"""The lagged-query state rolls back with the KV (issue 52): a crop, then the next step selects
exactly as a fresh cache fed the kept tokens would.

The lagged-query head selects a step's tokens with the query its retrieval layers computed
for the *previous* token (``aten_step.record_query`` keeps the last row of each step, stamped
with the length after it). A rollback (``cache.crop``: assisted and prompt-lookup decoding
drop rejected tokens; a hand-written speculative loop) keeps tokens whose query was
recorded by an earlier step, or by a middle row of a multi-token verification step. So the
retrieval state also keeps a short *history*, in the same tensors (no new graph input):

- ``query_state`` ``[QUERY_SLOTS, batch, heads, 1, width]``: slots ``0 .. 7`` the current
  queries (what the selection reads), then per retrieval slot ``i`` the queries of the last
  ``ROLLBACK_TOKENS`` positions (slot ``HISTORY + i * R + p % R`` for position ``p``), then
  per slot ``i`` a *fingerprint* of position ``p``: the retrieval layer's key row of its
  first KV head at ``p`` (``FINGERPRINT + i * R + p % R``, zero-padded to ``width``).
- ``query_valid`` int64 ``[QUERY_SLOTS]``: each entry's stamp (``p + 1``, 0 = empty).

:func:`record_rows` (after each ``record_query``, in every graph the head records in,
prefill included) writes every row of the step. :func:`restore` (in a decode graph, before the
selection) puts back, for each slot not stamped with the step's start length ``L``, the
history entry of position ``L - 1`` when its stamp is ``L`` and its fingerprint equals the
store's key row at ``L - 1`` (bitwise: the store keeps that very row): the same query a fresh
cache fed the kept tokens records, since a query is a function of its prefix, which the key
row fingerprints. Anything else (a crop deeper than ``ROLLBACK_TOKENS``, a prefill run
without the backend, a reset cache's new prompt) keeps the slot stale, and the step selects
by recency as before (counted: ``recency_fallback_steps``). Sync-free: ``where`` on the device.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from .retrieval import MAX_RETRIEVAL_LAYERS

__all__ = ["QUERY_SLOTS", "ROLLBACK_TOKENS", "crop_history", "record_rows", "restore"]

ROLLBACK_TOKENS = 32  # the deepest rollback that restores the lagged query (deeper: recency)
HISTORY = MAX_RETRIEVAL_LAYERS
FINGERPRINT = HISTORY + MAX_RETRIEVAL_LAYERS * ROLLBACK_TOKENS
QUERY_SLOTS = FINGERPRINT + MAX_RETRIEVAL_LAYERS * ROLLBACK_TOKENS


def _entries(base: int, slot, positions: torch.Tensor) -> torch.Tensor:
    """int64 ``[n]`` (or ``[slots]``): the entries of ``positions`` for ``slot`` (int, 0-d
    tensor, or int64 ``[n]``) in the area starting at ``base``."""
    return base + slot * ROLLBACK_TOKENS + positions % ROLLBACK_TOKENS


def _key_rows(key_cache, positions: torch.Tensor, width: int) -> torch.Tensor:
    """The fingerprint rows ``[batch, n, width]``: the store's first KV head at ``positions``
    (an MLA store pair: its latent rows), zero-padded or cut to ``width``."""
    keys = key_cache[0] if isinstance(key_cache, (tuple, list)) else key_cache
    rows = keys[:, 0].index_select(1, positions)[..., :width]
    return torch.nn.functional.pad(rows, (0, width - rows.shape[-1]))


@has_side_effect
def record_rows(query_state: torch.Tensor, query_valid: torch.Tensor, query: torch.Tensor,
                slot: int | torch.Tensor, length: torch.Tensor, key_cache) -> None:
    """Keep every row of this step's ``query`` ``[batch, heads, q_len, width]`` (the last
    ``ROLLBACK_TOKENS``) in slot ``slot``'s history with the store's key rows at those
    positions as fingerprints; ``length``: tokens written, this step's included."""
    if query_state.shape[0] < QUERY_SLOTS:  # a state without a history (sized by an older caller)
        return
    rows = query[:, :, -ROLLBACK_TOKENS:, :].detach()
    n = rows.shape[2]
    positions = length.reshape(1).to(torch.long) - n + torch.arange(n, device=query.device)
    stamps = (positions + 1).to(query_valid.dtype)
    width = query_state.shape[-1]
    entries = _entries(HISTORY, slot, positions)
    query_state.index_copy_(0, entries, rows.permute(2, 0, 1, 3).unsqueeze(3).to(query_state.dtype))
    query_valid.index_copy_(0, entries, stamps)
    prints = _key_rows(key_cache, positions, width).detach().to(query_state.dtype)  # [batch, n, width]
    fingerprint = query_state.new_zeros((n, *query_state.shape[1:]))
    fingerprint[:, :, 0, 0, :] = prints.permute(1, 0, 2)
    entries = _entries(FINGERPRINT, slot, positions)
    query_state.index_copy_(0, entries, fingerprint)
    query_valid.index_copy_(0, entries, stamps)


@has_side_effect
def restore(query_state: torch.Tensor, query_valid: torch.Tensor, cached: torch.Tensor, key_caches: list) -> None:
    """Before a decode step's selection: each of the first ``len(key_caches)`` slots not
    stamped ``cached`` (tokens written before this step) takes its history entry of position
    ``cached - 1`` when that entry is stamped ``cached`` and its fingerprint equals retrieval
    layer ``i``'s key row there (``key_caches[i]``); else it stays as it is."""
    layers = len(key_caches)
    if query_state.shape[0] < QUERY_SLOTS or layers == 0:
        return
    device = query_state.device
    cached = cached.reshape(1).to(torch.long)
    last = (cached - 1).clamp(min=0)
    slots = torch.arange(layers, device=device)
    history, prints = _entries(HISTORY, slots, last), _entries(FINGERPRINT, slots, last)
    width = query_state.shape[-1]
    stored = torch.stack([_key_rows(k, last, width)[:, 0] for k in key_caches])  # [layers, batch, width]
    kept = query_state.index_select(0, prints)[:, :, 0, 0, :]  # [layers, batch, width]
    same = (kept == stored.to(kept.dtype)).flatten(1).all(-1)
    found = (query_valid.index_select(0, history) == cached) & (query_valid.index_select(0, prints) == cached)
    take = found & same & (query_valid[:layers] != cached) & (cached > 0)
    current = query_state[:layers]
    query_state[:layers] = torch.where(take.view(-1, 1, 1, 1, 1), query_state.index_select(0, history), current)
    query_valid[:layers] = torch.where(take, cached.to(query_valid.dtype), query_valid[:layers])


def crop_history(query_valid: torch.Tensor, length: int) -> None:
    """After a crop to ``length`` tokens (host side): the current slots are stale (0) and
    history entries of dropped positions (stamp ``> length``) are forgotten, so no later step
    restores a dropped token's query."""
    query_valid[:HISTORY].zero_()
    query_valid[HISTORY:].masked_fill_(query_valid[HISTORY:] > length, 0)
