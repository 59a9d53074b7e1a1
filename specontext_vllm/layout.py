"""Where vLLM's CPU attention keeps each token's key and value inside a KV cache block.

vLLM's CPU cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` per layer, viewed
as ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` and split into a key area and a
value area of ``block_size * head_dim`` elements per block and KV head. Inside each area the
packing depends on the instruction set vLLM picked (``layer.isa``): on the vector path the
keys are transposed (``[head_dim, block_size]``), with AMX (bfloat16) keys and values are
packed in pairs for the tiles, values are plain rows elsewhere. Rather than restating those
rules, :func:`probe_layout` asks vLLM's own writer (``cpu_attn_reshape_and_cache``) where each
element of a block lands, once per (isa, dtype, block_size, head_dim), and
:class:`BlockLayout` gathers tokens through that map; a layout the probe cannot read (an
FP8 cache, a writer that scales) is refused with the setting that selects another.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import kernels

__all__ = ["FORMS", "BlockLayout", "probe_layout"]


#: the in-block forms vLLM's CPU writers use (offset of element ``j`` of row ``t``), by name:
#: plain rows (values on the vector path), transposed (keys on the vector path), and AMX's
#: bfloat16 tiles (keys: 16-token tiles of ``[head_dim / 2, 16, 2]`` dimension pairs; values:
#: 16-dimension tiles of ``[block_size / 2, 16, 2]`` token pairs), as read off vLLM 0.32's
#: writer by :func:`probe_layout`
FORMS = {
    "rows": lambda t, j, bs, d: t * d + j,
    "transposed": lambda t, j, bs, d: j * bs + t,
    "key-tiles16": lambda t, j, bs, d: (t // 16) * 16 * d + (j // 2) * 32 + (t % 16) * 2 + j % 2,
    "value-tiles16": lambda t, j, bs, d: (j // 16) * bs * 16 + (t // 2) * 32 + (j % 16) * 2 + t % 2,
}


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """How one block's key and value areas hold their tokens.

    Attributes:
        block_size: tokens per block.
        head_dim: elements per key and value row.
        key_form, value_form: the :data:`FORMS` entry each area matches, or None (then the
            element offsets are used one by one: correct, slower).
        key_offsets, value_offsets: int64 ``[block_size, head_dim]``: where element ``j`` of
            the token in row ``t`` of a block sits in the block's flat key (value) area of
            ``block_size * head_dim`` elements.
    """

    block_size: int
    head_dim: int
    key_form: str | None
    value_form: str | None
    key_offsets: torch.Tensor
    value_offsets: torch.Tensor

    def gather(self, kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
               with_values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys and values of some tokens of some requests, as plain rows.

        Args:
            kv_cache: one layer's cache ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``.
            block_table: int ``[rows, max_blocks]``: each request's blocks (vLLM's block table).
            positions: int64 ``[rows, num_kv_heads, n]``: token positions per row and KV head
                (``-1``: padding, read as position 0 and to be masked by the caller).

        Returns:
            keys, values: ``[rows, num_kv_heads, n, head_dim]`` in the cache's dtype (values
            None unless ``with_values``).
        """
        num_blocks, num_kv, block, _ = kv_cache.shape
        pos = positions.clamp(min=0)
        blocks = block_table.long().gather(1, (pos // block).flatten(1)).view_as(pos)  # [rows, kv, n]
        heads = torch.arange(num_kv, device=pos.device).view(1, num_kv, 1)
        area = (blocks * num_kv + heads) * 2  # index of the key area among [blocks * kv * 2] areas
        areas = kv_cache.view(num_blocks * num_kv * 2, block * self.head_dim)
        row = pos % block
        keys = self._read(areas, area, row, self.key_form, self.key_offsets)
        if not with_values:
            return keys, None
        return keys, self._read(areas, area + 1, row, self.value_form, self.value_offsets)

    def _read(self, areas, area, row, form, offsets):
        """Rows ``row`` of areas ``area`` (both int64 ``[...]``) -> ``[..., head_dim]``."""
        bs, d = self.block_size, self.head_dim
        if form == "rows":
            return areas.view(-1, bs, d)[area, row]
        if form == "transposed":
            return areas.view(-1, d, bs)[area, :, row]
        if form == "key-tiles16":
            return areas.view(-1, bs // 16, d // 2, 16, 2)[area, row // 16, :, row % 16].flatten(-2)
        if form == "value-tiles16":
            return areas.view(-1, d // 16, bs // 2, 16, 2)[area, :, row // 2, :, row % 2].flatten(-2)
        return areas.view(-1)[(area * bs * d)[..., None] + offsets[row]]

    def lagged_scores(self, caches: list[torch.Tensor], block_table: torch.Tensor, blocks: int,
                      queries: list[torch.Tensor], scale: float, past: torch.Tensor) -> torch.Tensor | None:
        """The lagged-query scores of several layers in one call of the plugin's C++ kernel
        (:func:`~.kernels.paged_lagged_scores`; ``queries``: each layer's ``[rows, num_heads,
        head_dim]``; ``past``: int ``[rows]``), or None where it does not read this packing
        (then :meth:`key_logits` per layer)."""
        if (self.key_form, caches[0].dtype) not in kernels.FORM_CODES or not kernels.available():
            return None
        rows, num_kv = block_table.shape[0], caches[0].shape[1]
        q = torch.stack([(query.float() * scale).view(rows, num_kv, -1, self.head_dim) for query in queries])
        return kernels.paged_lagged_scores(caches, block_table, blocks, q, past, self.key_form)

    def key_logits(self, kv_cache: torch.Tensor, block_table: torch.Tensor, blocks: int, query: torch.Tensor,
                   scale: float) -> torch.Tensor:
        """float32 ``(query * scale) . key`` of every token of each row's first ``blocks``
        blocks, read block by block in the cache's own packing: the plugin's C++ kernel where it
        reads the form (:mod:`.kernels`), else one contiguous copy per block and torch.

        Args:
            kv_cache: one layer's cache ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``.
            block_table: int ``[rows, >= blocks]``.
            query: ``[rows, num_heads, head_dim]`` (heads grouped by KV head).

        Returns:
            float32 ``[rows, num_kv_heads, num_heads // num_kv_heads, blocks * block_size]``;
            positions past a row's blocks read whatever block 0 of the table's padding holds
            (the caller masks them).
        """
        num_blocks, num_kv, bs, _ = kv_cache.shape
        rows, d = block_table.shape[0], self.head_dim
        if (self.key_form, kv_cache.dtype) in kernels.FORM_CODES and kernels.available():
            q = (query.float() * scale).view(rows, num_kv, -1, d)
            return kernels.paged_key_logits(kv_cache, block_table, blocks, q, self.key_form)
        areas = kv_cache.view(num_blocks * num_kv * 2, bs * d)
        heads = torch.arange(num_kv, device=kv_cache.device).view(1, num_kv, 1)
        index = (block_table[:, :blocks].long().unsqueeze(1) * num_kv + heads) * 2  # key areas [rows, kv, blocks]
        packed = areas.index_select(0, index.flatten()).view(rows, num_kv, blocks, bs * d)
        q = (query.float() * scale).to(kv_cache.dtype).view(rows, num_kv, -1, d)
        if self.key_form == "transposed":  # [rows, kv, blocks, groups, bs]
            logits = torch.matmul(q.unsqueeze(2), packed.view(rows, num_kv, blocks, d, bs)).transpose(2, 3)
        elif self.key_form == "rows":
            logits = torch.matmul(q.unsqueeze(2), packed.view(rows, num_kv, blocks, bs, d).transpose(-1, -2)
                                  ).transpose(2, 3)
        elif self.key_form == "key-tiles16":
            tiles = packed.view(rows, num_kv, blocks, bs // 16, d // 2, 16, 2)
            logits = torch.einsum("rkgpc,rkntpsc->rkgnts", q.view(rows, num_kv, -1, d // 2, 2), tiles)
        else:
            keys = self.whole(kv_cache, block_table, blocks * bs)
            logits = torch.einsum("rkgd,rknd->rkgn", q, keys)
        return logits.reshape(rows, num_kv, q.shape[2], blocks * bs).float()

    def whole(self, kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """The keys of positions ``0 .. length-1`` of every row: ``[rows, num_kv_heads, length,
        head_dim]`` (the selection scores them all)."""
        rows, num_kv = block_table.shape[0], kv_cache.shape[1]
        positions = torch.arange(length, device=kv_cache.device).expand(rows, num_kv, length)
        return self.gather(kv_cache, block_table, positions, with_values=False)[0]


def probe_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> BlockLayout:
    """Ask vLLM's writer where each element of a block goes (cached per arguments).

    Raises:
        ValueError: when the writer does not place each written element exactly once (a
            quantized or scaled cache): set ``kv_cache_dtype="auto"``.
    """
    return _probe(isa, dtype, block_size, head_dim)


@functools.cache
def _probe(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> BlockLayout:
    from vllm import _custom_ops as ops

    cache = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
    key_area, value_area = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
    slots = torch.arange(block_size)
    offsets = {}
    # two writes: the token row of each element, then its column (small integers: exact in bf16)
    for name, ids in (("row", slots.view(-1, 1).expand(block_size, head_dim)),
                      ("col", torch.arange(head_dim).view(1, -1).expand(block_size, head_dim))):
        cache.zero_()
        marked = (ids + 1).to(dtype).view(block_size, 1, head_dim)
        ops.cpu_attn_reshape_and_cache(marked, marked, key_area, value_area, slots, isa)
        offsets[name] = cache.view(2, block_size * head_dim).long() - 1  # [key|value, area]
    maps = []
    for area in range(2):
        row, col = offsets["row"][area], offsets["col"][area]
        index = row * head_dim + col
        if row.min() < 0 or not torch.equal(index.sort().values, torch.arange(block_size * head_dim)):
            raise ValueError(f"specontext: cannot read vLLM's {isa} KV cache layout for {dtype} (a quantized "
                             "or scaled cache?): serve with kv_cache_dtype='auto'")
        where = torch.empty_like(index)
        where[index] = torch.arange(index.numel())
        maps.append(where.view(block_size, head_dim))
    forms = [_form(m, block_size, head_dim) for m in maps]
    return BlockLayout(block_size, head_dim, forms[0], forms[1], maps[0], maps[1])


def _form(offsets: torch.Tensor, block_size: int, head_dim: int) -> str | None:
    """The :data:`FORMS` entry whose offsets equal ``offsets`` ``[block_size, head_dim]``, or None."""
    t = torch.arange(block_size).view(-1, 1)
    j = torch.arange(head_dim).view(1, -1)
    return next((name for name, f in FORMS.items() if torch.equal(f(t, j, block_size, head_dim).expand_as(offsets),
                                                               offsets)), None)
