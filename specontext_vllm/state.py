"""The lagged-query record beside vLLM's blocks (issue 54, item 2).

A retrieval layer keeps, per KV cache block, the query row of the last token it wrote there and
that token's physical KV row (its stamp). The next step's selection for a request reads the
block of its previous token and uses the query only if the stamp is that token's row: a block
freed and reused by another request, a preemption that dropped the request's blocks, or a
step run without the plugin can never lend a stale query (the row then ranks by recency). A
full block shared by prefix caching keeps the query its tokens produced, which is the same
for every request sharing the prefix (the same tokens at the same positions).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["LaggedQueries"]


@dataclasses.dataclass
class LaggedQueries:
    """One retrieval layer's record.

    Attributes:
        queries: ``[num_blocks + 1, num_heads, head_dim]``, the last query row written per
            block; the last row is a spare that takes the writes of padding slots (so a write
            needs no host read to drop them) and is never read.
        stamps: int64 ``[num_blocks + 1]``, the physical KV row (``block * block_size + offset``)
            of that query's token; ``-1`` = none.
        block_size: tokens per block.
    """

    queries: torch.Tensor
    stamps: torch.Tensor
    block_size: int

    @classmethod
    def for_cache(cls, kv_cache: torch.Tensor, num_heads: int, head_dim: int) -> LaggedQueries:
        """An empty record for a layer's cache ``[num_blocks, num_kv_heads, block_size, 2 *
        head_dim]`` (queries kept in the cache's dtype)."""
        blocks, _, block_size, _ = kv_cache.shape
        return cls(kv_cache.new_zeros(blocks + 1, num_heads, head_dim),
                   torch.full((blocks + 1,), -1, dtype=torch.long, device=kv_cache.device), block_size)

    def write(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Record query rows ``[n, num_heads, head_dim]`` of tokens written at KV rows ``slots``
        (int ``[n]``, at most one per block; negative slots, vLLM's padding, land in the spare
        row: no boolean indexing, no host read)."""
        slots = slots.long()
        padding = slots < 0
        blocks = torch.where(padding, self.stamps.shape[0] - 1, slots // self.block_size)
        self.queries.index_copy_(0, blocks, rows.to(self.queries.dtype))
        self.stamps.index_copy_(0, blocks, slots)  # the spare row's stamp is never read

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded query rows ``[n, num_heads, head_dim]`` of the tokens at KV rows
        ``slots`` (int64 ``[n]``) and whether each is theirs (bool ``[n]``)."""
        blocks = (slots // self.block_size).clamp(min=0)
        return self.queries[blocks], (self.stamps[blocks] == slots) & (slots >= 0)
