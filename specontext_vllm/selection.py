"""The step's selection for vLLM's decode rows: the product's scorer, whole blocks kept.

vLLM's CPU cache spreads a token's key over its whole block (transposed on the vector path,
tiled for AMX), so reading a few tokens of a block costs about as much as reading the block:
the plugin selects **whole blocks** (pages of ``block_size`` tokens, as Quest does), per request
and KV head, and the decode rows then attend with vLLM's own kernel over a block table of the
selected blocks (:mod:`.backend`).

Per decode row ``r`` of length ``L_r`` (tokens, this step's included) and KV head: the
lagged-query scores of its past tokens (as :func:`specontext_compile.runtime.scorers.lagged_query_score`
defines them: the retrieval layers' recorded queries of token ``L_r - 2`` over positions
``< L_r - 1``, computed on the cache's packed blocks), a
block's score the max over its tokens, then
:func:`specontext_compile.runtime.aten_step.select_positions` over the row's blocks:
``budget // block_size`` blocks, the first ``ceil(sink_tokens / block_size)`` (attention sinks)
and the blocks holding the last ``recent_window`` tokens (the current block included) always,
the top-scored blocks for the rest. A row with no more blocks than that keeps them all (its
attention is exactly dense). Rows are batched to the longest with a per-row visibility mask,
so each row selects as it would alone (SpeContext section 4).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch
from specontext_compile.runtime.aten_step import select_positions
from specontext_compile.runtime.int8_keys import dequantize_rows, quantize_rows
from specontext_compile.runtime.sparse_attention import group_max_probs

from . import kernels
from .int8_keys import Int8Keys
from .layout import BlockLayout
from .options import PluginOptions
from .state import LaggedQueries

__all__ = ["BlockSelection", "block_counts", "every_block", "previous_slots", "select_blocks", "with_blocks",
           "with_dense_rows"]


@dataclasses.dataclass
class BlockSelection:
    """The step's selection, per KV head, as vLLM's kernel reads it.

    Attributes:
        logical: int64 ``[rows, num_kv_heads, blocks]`` selected logical block indices of each
            row, ascending, ``-1`` padding last.
        tables: int32 ``[rows, num_kv_heads, blocks]`` the physical blocks of ``logical``
            (padding: block 0, never read).
        seq_lens: int32 ``[rows, num_kv_heads]`` tokens the kernel reads per row and KV head:
            whole selected blocks, then the current block's written tokens.
        recency_rows: int64 scalar, the rows ranked by recency (no usable record).
        blocks: the longest row's blocks (the step's one host read, reused by every layer).
    """

    logical: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor
    recency_rows: torch.Tensor
    blocks: int


def previous_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[rows]``: the KV row of each row's previous token (position ``L - 2``; ``-1``
    when ``L < 2``)."""
    prev = (seq_lens.long() - 2).clamp(min=0)
    blocks = block_table.long().gather(1, (prev // block_size).unsqueeze(1)).squeeze(1)
    return torch.where(seq_lens >= 2, blocks * block_size + prev % block_size, -1)


def block_counts(options: PluginOptions, block_size: int) -> tuple[int, int, int]:
    """``(blocks kept, sink blocks, recent blocks)`` for ``options`` and ``block_size``: the
    shared selection's tokens (``candidates x budget``, :meth:`~.options.PluginOptions.selected_tokens`)
    in whole blocks (at least the forced ones), the blocks of the first ``sink_tokens``
    tokens, and the blocks that can hold the last ``recent_window`` tokens (the current one
    and ``ceil((recent_window - 1) / block_size)`` before it)."""
    sinks = math.ceil(options.sink_tokens / block_size)
    recent = 1 + math.ceil(max(options.recent_window - 1, 0) / block_size)
    tokens = options.selected_tokens()
    kept = sys.maxsize if tokens is None else tokens // block_size
    return max(kept, sinks + recent, 1), sinks, recent


def _int8_scores(copies: list[Int8Keys], block_table, blocks, queries, scale, past, dtype):
    """The scores over the retrieval layers' int8 keys (``queries``: each layer's ``[rows,
    num_heads, head_dim]``; ``past``: int64 ``[rows]``), the query scaled, rounded to the
    cache's ``dtype`` and then to int8 rows, as the backend's selection scores its int8 keys
    (:func:`specontext_compile.runtime.cpu_selection.lagged_scores`): one call of the C++
    kernel where it builds, else per layer in torch over the dequantized rows
    (:meth:`~.int8_keys.Int8Keys.logits`)."""
    rows, num_kv, d = block_table.shape[0], copies[0].levels.shape[1], copies[0].levels.shape[-1]
    q = torch.stack([(query.float() * scale).to(dtype).float().view(rows, num_kv, -1, d) for query in queries])
    levels, scales = quantize_rows(q)
    if kernels.available():
        return kernels.paged_lagged_scores_int8(copies, block_table, blocks, (levels, scales), past)
    values = dequantize_rows(levels, scales)
    weighed = torch.arange(blocks * copies[0].block_size, device=past.device) < past.view(rows, 1, 1)
    return sum(group_max_probs(copy.logits(block_table, blocks, qi), weighed) for copy, qi in zip(copies, values))


def _token_scores(records, caches, block_table, seq_lens, layout, scale, blocks, copies=None):
    """float32 ``[rows, kv, blocks * block_size]`` lagged-query scores (recency where not
    ready) and the bool ``[rows]`` readiness. The scores are the lagged-query head's
    (:func:`specontext_compile.runtime.scorers.lagged_query_score`): per retrieval layer the
    group-max softmax (:func:`~specontext_compile.runtime.sparse_attention.group_max_probs`)
    of its recorded query's logits over the row's past tokens, summed; over the layers' int8
    keys where ``copies`` are given (option ``selection_keys="int8"``, :mod:`.int8_keys`), else
    one kernel call over every layer where it reads the packing
    (:meth:`~.layout.BlockLayout.lagged_scores`), else per layer from the packed blocks
    (:meth:`~.layout.BlockLayout.key_logits`)."""
    rows, length = seq_lens.shape[0], blocks * layout.block_size
    pos = torch.arange(length, device=seq_lens.device)
    num_kv = caches[0].shape[1]
    recency = pos.to(torch.float32).expand(rows, num_kv, length)
    if records is None:
        return recency, torch.zeros(rows, dtype=torch.bool, device=seq_lens.device)
    slots = previous_slots(block_table, seq_lens, layout.block_size)
    reads = [record.read(slots) for record in records]
    ready = torch.stack([ok for _, ok in reads]).all(0)
    past = (seq_lens.long() - 1).clamp(min=0)
    if copies is not None:
        total = _int8_scores(copies, block_table, blocks, [query for query, _ in reads], scale, past, caches[0].dtype)
    else:  # one call, logits never written
        total = layout.lagged_scores(caches, block_table, blocks, [query for query, _ in reads], scale, past)
    if total is None:  # a packing the kernel does not read: per layer, torch
        past = pos < seq_lens.long().view(rows, 1, 1) - 1  # the row's past tokens
        total = sum(group_max_probs(layout.key_logits(cache, block_table, blocks, query, scale), past)
                    for (query, _), cache in zip(reads, caches))
    return torch.where(ready.view(rows, 1, 1), total, recency), ready


def select_blocks(records: list[LaggedQueries] | None, caches: list[torch.Tensor], block_table: torch.Tensor,
                  seq_lens: torch.Tensor, layout: BlockLayout, options: PluginOptions, scale: float,
                  copies: list[Int8Keys] | None = None) -> BlockSelection:
    """The selection of every decode row.

    Args:
        records: the retrieval layers' records (None: nothing recorded yet, rank by recency).
        caches: the retrieval layers' KV caches ``[num_blocks, num_kv_heads, block_size, 2 *
            head_dim]``, in the order of ``records``.
        block_table: int ``[rows, max_blocks]``; seq_lens: int ``[rows]`` (this step's token
            included, already written in the layers that attend).
        layout: where tokens sit in a block (:func:`~.layout.probe_layout`).
        options: budget, sinks, recent window.
        scale: the retrieval layers' softmax scale.
        copies: the retrieval layers' int8 keys (:class:`~.int8_keys.Int8Keys`, in the order of
            ``records``; option ``selection_keys="int8"``), scored instead of ``caches``; None:
            the caches' keys.
    """
    rows, bs = seq_lens.shape[0], layout.block_size
    blocks = -(-int(seq_lens.max()) // bs)
    scores, ready = _token_scores(records, caches, block_table, seq_lens, layout, scale, blocks, copies)
    block_scores = scores.view(rows, -1, blocks, bs).amax(-1)  # [rows, kv, blocks]
    kept, sinks, recent = block_counts(options, bs)
    row_blocks = (seq_lens.long() + bs - 1) // bs
    visible = torch.arange(blocks, device=seq_lens.device) < row_blocks.view(rows, 1, 1)
    cached = torch.tensor(blocks - 1, device=seq_lens.device)
    logical = select_positions(block_scores, cached, 1, min(kept, blocks), sinks, recent, 0, visible)
    return with_blocks(logical, block_table, seq_lens, bs, (~ready).sum(), blocks)


def with_blocks(logical: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                recency_rows: torch.Tensor, blocks: int) -> BlockSelection:
    """The :class:`BlockSelection` of logical blocks ``[rows, num_kv_heads, n]`` (any order,
    unique per row and KV head, ``-1`` = none; the current block among them): sorted, mapped to
    physical blocks through ``block_table``, with the tokens vLLM's kernel reads per row
    (``blocks``: the longest row's, kept on the result)."""
    rows, spare = seq_lens.shape[0], block_table.shape[1]
    logical = torch.where(logical < 0, spare, logical).sort(-1).values  # padding last
    valid = logical < spare
    logical = torch.where(valid, logical, -1)
    physical = block_table.long().gather(1, logical.clamp(min=0).flatten(1)).view_as(logical)
    tables = torch.where(valid, physical, 0).to(torch.int32)
    last = (seq_lens.long() - 1) % block_size + 1  # written tokens of the current (last selected) block
    lens = (valid.sum(-1) - 1) * block_size + last.view(rows, 1)  # [rows, kv]
    return BlockSelection(logical, tables, lens.to(torch.int32), recency_rows, blocks)


def with_dense_rows(selection: BlockSelection | None, dense: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, block_size: int, num_kv_heads: int) -> BlockSelection:
    """``selection`` with the rows of ``dense`` (bool ``[rows]``; option ``dense_below``)
    selecting every block of their request, for each of the ``num_kv_heads`` KV heads: vLLM's
    kernel then attends to their whole KV, exact. ``selection`` None: every row dense (no
    scores made)."""
    rows = seq_lens.shape[0]
    blocks = -(-int(seq_lens.max()) // block_size)
    if selection is None:
        return every_block(block_table, seq_lens, block_size, blocks, num_kv_heads)
    width = selection.logical.shape[-1]
    blocks = max(blocks, selection.blocks, width)
    every = every_block(block_table, seq_lens, block_size, blocks, num_kv_heads).logical
    logical = torch.nn.functional.pad(selection.logical, (0, blocks - width), value=-1)
    logical = torch.where(dense.view(rows, 1, 1), every, logical)
    return with_blocks(logical, block_table, seq_lens, block_size, selection.recency_rows, blocks)


def every_block(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, blocks: int,
                num_kv_heads: int) -> BlockSelection:
    """The :class:`BlockSelection` of every written block of each row (``blocks``: the longest
    row's), for ``num_kv_heads`` KV heads: dense attention through vLLM's kernel."""
    rows = seq_lens.shape[0]
    row_blocks = (seq_lens.long() + block_size - 1) // block_size
    every = torch.arange(blocks, device=seq_lens.device).view(1, 1, blocks).expand(rows, num_kv_heads, blocks)
    logical = torch.where(every < row_blocks.view(rows, 1, 1), every, -1)
    return with_blocks(logical, block_table, seq_lens, block_size, torch.zeros((), dtype=torch.int64), blocks)

