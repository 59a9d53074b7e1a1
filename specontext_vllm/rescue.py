"""The per-layer page rescue over vLLM's blocks (issue 54, item 1; option ``page_rescue``).

The step's shared selection (:mod:`.selection`) comes from the retrieval layers' lagged
queries, once per step; a layer whose own query attends where that selection missed loses those
tokens. As our backend does (``page_rescue``, docs/options.md), each layer adds the pages with the
highest **Quest bound** under its own query (Tang et al. 2024: per page and dimension the
minimum and maximum key; ``sum_j max(q_j * low_j, q_j * high_j)`` bounds every logit of the
page). A page here is one of vLLM's KV blocks, and its bounds live beside it
(:class:`PageBounds`, keyed by physical block, so they follow the block as the keys do: a
block written from its first slot, whether new, reused or recomputed after a preemption,
starts fresh bounds; a full block shared by prefix caching keeps the bounds of its own tokens).

As in the backend, the rescued blocks' tokens join the layer's candidates, which the layer
then *refines* back to ``budget`` tokens by its own query's exact logits (:mod:`.refine`): the
rescued blocks are chosen per request, KV head and layer.
"""

from __future__ import annotations

import dataclasses

import torch
from specontext_compile.runtime.page_bounds import page_scores

from . import kernels

__all__ = ["PageBounds", "quest_bounds", "rescue_blocks"]


@dataclasses.dataclass
class PageBounds:
    """One layer's per-block key bounds.

    Attributes:
        low, high: float32 ``[num_blocks, num_kv_heads, head_dim]``: the elementwise minimum and
            maximum of the keys written in each block (a block with nothing written holds
            ``+inf`` / ``-inf``).
        block_size: tokens per block.
    """

    low: torch.Tensor
    high: torch.Tensor
    block_size: int

    @classmethod
    def for_cache(cls, kv_cache: torch.Tensor, head_dim: int) -> PageBounds:
        """Empty bounds for a layer's cache ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``."""
        blocks, num_kv, block_size, _ = kv_cache.shape
        low = torch.full((blocks, num_kv, head_dim), float("inf"), device=kv_cache.device)
        return cls(low, -low, block_size)

    def write(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Fold keys ``[n, num_kv_heads, head_dim]`` written at KV rows ``slots`` (int ``[n]``;
        negative = vLLM's padding, skipped) into their blocks' bounds. A block receiving its
        first slot starts over (it holds a new token sequence)."""
        keep = slots[: keys.shape[0]] >= 0
        slots = slots[: keys.shape[0]][keep].long()
        keys = keys[keep].float()
        blocks = slots // self.block_size
        fresh = blocks[slots % self.block_size == 0]
        self.low.index_fill_(0, fresh, float("inf"))
        self.high.index_fill_(0, fresh, float("-inf"))
        self.low.index_reduce_(0, blocks, keys, "amin")
        self.high.index_reduce_(0, blocks, keys, "amax")


def quest_bounds(bounds: PageBounds, block_table: torch.Tensor, blocks: int, query: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, num_kv_heads, blocks]``: per row, KV head and logical block, the
    largest Quest bound over the KV head's query heads (the group-max, as the lagged-query
    scorer takes it) of ``query`` ``[rows, num_heads, head_dim]`` (heads grouped by KV head):
    the plugin's C++ kernel (:func:`~.kernels.paged_quest_bounds`) where it builds, else the
    backend's torch bound (:func:`specontext_compile.runtime.page_bounds.page_scores`)."""
    rows = block_table.shape[0]
    if kernels.available():
        q = query.float().view(rows, bounds.low.shape[1], -1, bounds.low.shape[2])
        return kernels.paged_quest_bounds(bounds.low, bounds.high, block_table, blocks, q)
    physical = block_table[:, :blocks].long()
    # the backend's Quest bound over pages [rows, kv, blocks, d] (every block counted as seen)
    low, high = (b[physical].transpose(1, 2) for b in (bounds.low, bounds.high))
    seen = torch.ones(1, 1, blocks * bounds.block_size, dtype=torch.bool, device=query.device)
    return page_scores(query.unsqueeze(2), low, high, seen, 1.0, bounds.block_size)


def rescue_blocks(bounds: PageBounds, block_table: torch.Tensor, seq_lens: torch.Tensor, query: torch.Tensor,
                  selected: torch.Tensor, count: int, blocks: int) -> torch.Tensor:
    """The logical blocks each decode row and KV head adds at this layer.

    Args:
        bounds: the layer's :class:`PageBounds`.
        block_table: int ``[rows, max_blocks]``; seq_lens: int ``[rows]`` (this step's token
            included).
        query: the layer's query ``[rows, num_heads, head_dim]``.
        selected: int64 ``[rows, num_kv_heads, kept]`` the shared selection's logical blocks
            (``-1`` padding), which are not added again.
        count: blocks to add per row and KV head (``page_rescue // block_size``).
        blocks: the longest row's blocks (read once per step by the selection: no host read here).

    Returns:
        int64 ``[rows, num_kv_heads, count]``: the top-``count`` blocks by Quest bound among
        the row's written blocks outside ``selected``, ``-1`` where fewer remain.
    """
    rows, bs = seq_lens.shape[0], bounds.block_size
    # a written block whose bounds were never seen would score NaN: rank it first (never dropped)
    score = quest_bounds(bounds, block_table, blocks, query).nan_to_num(nan=float("inf"))  # [rows, kv, blocks]
    row_blocks = (seq_lens.long() + bs - 1) // bs
    written = torch.arange(blocks, device=score.device) < row_blocks.view(rows, 1, 1)
    num_kv = score.shape[1]
    taken = torch.zeros(rows, num_kv, blocks + 1, dtype=torch.bool, device=score.device)
    taken.scatter_(-1, torch.where(selected >= 0, selected, blocks), True)  # padding -> the spare column
    score = score.masked_fill(~written | taken[..., :blocks], float("-inf"))
    count = min(count, blocks)
    top = score.topk(count, dim=-1)
    return torch.where(top.values > float("-inf"), top.indices, -1)
