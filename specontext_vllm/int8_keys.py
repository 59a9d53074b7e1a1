"""The selection's int8 copy of a retrieval layer's keys, beside vLLM's blocks (option
``selection_keys="int8"``, the backend's default; issue 51 item 2, issue 54).

Once per step the lagged-query selection scores every past token of every decode row on the
retrieval layers (SpeContext section 4): at 8 requests of 7.7K tokens that is 377 MB of float32
keys a step on SmolLM2's eight retrieval layers, read in vLLM's packing. With this copy the
selection reads each key as 64 int8 levels and one float32 scale (68 bytes at head_dim 64,
against 256 in float32 and 128 in bfloat16), rounded as the backend's copy is
(:func:`specontext_compile.runtime.int8_keys.quantize_rows`: ``scale = max |k| / 127`` per token
and KV head, levels rounded to nearest). Attention, the rescue's bounds and the refinement read
vLLM's cache as before.

Invariants:

* **Written with the keys.** A retrieval layer writes the rows of every key vLLM writes in its
  step (prefill, chunked prefill and decode, at the same slots), so a slot's row is the
  quantized key vLLM holds there: preemption, recomputation and block reuse rewrite both, and
  a full block shared by prefix caching keeps its own tokens' rows.
* **No host read.** vLLM's padding slots (negative) land in a spare block that is never read.
"""

from __future__ import annotations

import dataclasses

import torch
from specontext_compile.runtime.int8_keys import quantize_rows

__all__ = ["Int8Keys"]


@dataclasses.dataclass
class Int8Keys:
    """One retrieval layer's int8 keys.

    Attributes:
        levels: int8 ``[num_blocks + 1, num_kv_heads, block_size, head_dim]``, token-major rows
            (the last block: the spare that takes padding slots).
        scales: float32 ``[num_blocks + 1, num_kv_heads, block_size]``: a key is ``levels *
            scale``, each entry within half a scale.
        block_size: tokens per block.
    """

    levels: torch.Tensor
    scales: torch.Tensor
    block_size: int

    @classmethod
    def for_cache(cls, kv_cache: torch.Tensor, head_dim: int) -> Int8Keys:
        """Zeroed rows for a layer's cache ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
        (bytes: ``(num_blocks + 1) * num_kv_heads * block_size * (head_dim + 4)``)."""
        blocks, num_kv, block_size, _ = kv_cache.shape
        levels = torch.zeros(blocks + 1, num_kv, block_size, head_dim, dtype=torch.int8, device=kv_cache.device)
        scales = torch.zeros(blocks + 1, num_kv, block_size, dtype=torch.float32, device=kv_cache.device)
        return cls(levels, scales, block_size)

    def fits(self, kv_cache: torch.Tensor) -> bool:
        """Whether these rows were made for ``kv_cache``'s block count (vLLM may reallocate)."""
        return self.levels.shape[0] == kv_cache.shape[0] + 1

    def write(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """The rows of keys ``[n, num_kv_heads, head_dim]`` written at KV rows ``slots`` (int
        ``[>= n]``, the first ``n`` used; negative = vLLM's padding, sent to the spare block)."""
        n = keys.shape[0]
        slots = slots[:n].long()
        spare = self.levels.shape[0] - 1
        block = torch.where(slots < 0, spare, slots // self.block_size)
        offset = torch.where(slots < 0, 0, slots % self.block_size)
        levels, scales = quantize_rows(keys)
        self.levels[block, :, offset] = levels
        self.scales[block, :, offset] = scales

    def logits(self, block_table: torch.Tensor, blocks: int, query: torch.Tensor) -> torch.Tensor:
        """float32 ``[rows, num_kv_heads, groups, blocks * block_size]`` logits of ``query``
        (float32 ``[rows, num_kv_heads, groups, head_dim]``, already scaled) over the
        dequantized keys of each row's first ``blocks`` blocks (``block_table`` int ``[rows,
        >= blocks]``): the torch path, where :func:`~.kernels.paged_lagged_scores_int8` does not
        build, and the tests' reference."""
        table = block_table[:, :blocks].long()
        rows, num_kv = table.shape[0], self.levels.shape[1]
        keys = self.levels[table].float() * self.scales[table].unsqueeze(-1)  # [rows, blocks, kv, bs, d]
        keys = keys.permute(0, 2, 1, 3, 4).reshape(rows, num_kv, blocks * self.block_size, -1)
        return torch.einsum("rkgd,rknd->rkgn", query.float(), keys)
