"""Random inputs for the kernel property tests, `benchmarks.kernel_errors` and the GPU benchmark.

Every case follows the kernel contract: selections are unique per row, unsorted, always hold
the newest token, may be shorter than the budget (``-1`` padding at random slots) and the
budget may exceed the context. Cache slots a kernel must never read (unselected ones and
everything at or past ``valid_length``) can be poisoned with NaN, so one stray load shows up
as NaN in the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specontext_compile.codegen.reference import reference_sparse_decode_attention
from specontext_compile.codegen.spec import torch_dtype

__all__ = ["AttentionCase", "make_attention_case", "make_selection", "strided_cache"]


def strided_cache(
    batch: int,
    num_kv: int,
    capacity: int,
    dim: int,
    dtype: torch.dtype,
    layout: str,
    gen: torch.Generator,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """A ``[batch, num_kv, capacity, dim]`` cache filled with N(0, 1).

    ``layout``: ``"contiguous"``; ``"token_major"`` (storage ``[batch, capacity, num_kv,
    dim + 8]``, a permuted and sliced view: no stride is the contiguous one but the last).
    """
    if layout == "contiguous":
        data = torch.randn(batch, num_kv, capacity, dim, generator=gen, dtype=torch.float32)
        return data.to(device=device, dtype=dtype)
    if layout != "token_major":
        raise ValueError(f"unknown layout {layout!r}")
    data = torch.randn(batch, capacity, num_kv, dim + 8, generator=gen, dtype=torch.float32)
    return data.to(device=device, dtype=dtype).permute(0, 2, 1, 3)[..., :dim]


def make_selection(
    lengths: list[int], num_kv: int, budget: int, gen: torch.Generator, fill: float = 1.0
) -> torch.Tensor:
    """int64 ``[batch, num_kv, budget]`` selection: per row, the newest token ``L - 1`` plus a
    random subset of ``[0, L - 1)``, unsorted, at random slots; ``-1`` elsewhere.

    ``fill`` in (0, 1]: share of ``min(budget, L)`` slots used (at least one).
    """
    batch = len(lengths)
    out = torch.full((batch, num_kv, budget), -1, dtype=torch.int64)
    for b, length in enumerate(lengths):
        for h in range(num_kv):
            if length <= 0:
                continue
            room = min(budget, length)
            count = max(1, min(room, round(room * fill)))
            older = torch.randperm(length - 1, generator=gen)[: count - 1]
            chosen = torch.cat([older, torch.tensor([length - 1])])
            slots = torch.randperm(budget, generator=gen)[:count]
            out[b, h, slots] = chosen[torch.randperm(count, generator=gen)]
    return out


def _poison(cache: torch.Tensor, indices: torch.Tensor) -> None:
    """NaN into every slot of ``cache`` that ``indices`` does not select (in place)."""
    batch, num_kv, capacity, _ = cache.shape
    keep = torch.zeros(batch, num_kv, capacity + 1, dtype=torch.bool)
    keep.scatter_(2, torch.where(indices >= 0, indices, capacity), True)
    cache.masked_fill_(~keep[..., :capacity, None].to(cache.device), float("nan"))


@dataclass
class AttentionCase:
    """Inputs of one sparse decode attention call plus what is needed to check it."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    indices: torch.Tensor
    valid_length: torch.Tensor
    options: dict = field(default_factory=dict)  # scale, soft_cap, sliding_window
    query_rope: torch.Tensor | None = None
    rope_cache: torch.Tensor | None = None
    value_scale: float = 1.0  # max |v| over selected slots

    def run(self, **kwargs) -> torch.Tensor:
        """The generated kernel on this case (the MLA one when there is a rope part);
        ``kwargs`` (``out``, ``num_splits``, ``block_n``, ...) override :attr:`options`."""
        from specontext_compile.codegen.attention import sparse_decode_attention, sparse_mla_decode_attention

        options = {**self.options, **kwargs}
        if self.rope_cache is None:
            return sparse_decode_attention(self.query, self.key_cache, self.value_cache,
                                           self.indices, self.valid_length, **options)
        return sparse_mla_decode_attention(self.query, self.query_rope, self.key_cache,
                                           self.rope_cache, self.indices, self.valid_length,
                                           **options)

    def reference(self) -> torch.Tensor:
        """float64 reference output."""
        if self.rope_cache is None:
            return reference_sparse_decode_attention(
                self.query,
                self.key_cache,
                self.value_cache,
                self.indices,
                self.valid_length,
                **self.options,
            )
        return reference_sparse_decode_attention(
            torch.cat([self.query, self.query_rope], -1),
            torch.cat([self.key_cache, self.rope_cache], -1),
            self.key_cache,
            self.indices,
            self.valid_length,
            **self.options,
        )


def make_attention_case(
    *,
    seed: int,
    dtype: str = "bf16",
    batch: int = 1,
    num_kv: int = 1,
    group: int = 1,
    q_len: int = 1,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    rope_dim: int = 0,
    lengths: list[int] | None = None,
    extra_capacity: int = 3,
    budget: int = 16,
    fill: float = 1.0,
    scalar_length: bool = False,
    layout: str = "contiguous",
    logit_scale: float = 1.0,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    poison: bool = True,
    device: str | torch.device = "cpu",
) -> AttentionCase:
    """One random case following the kernel contract (see module docstring).

    ``lengths`` (per request; default ``[budget]``) become ``valid_length`` (a ``[]`` tensor
    when ``scalar_length``, which requires equal lengths). The cache holds
    ``max(lengths) + extra_capacity`` slots. ``logit_scale`` multiplies ``head_dim ** -0.5``.
    With ``rope_dim > 0`` the case is MLA: ``key_cache`` is the latent cache (also the value).
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = list(lengths or [budget] * batch)
    tdtype = torch_dtype(dtype)
    capacity = max(lengths) + extra_capacity
    heads = num_kv * group
    width = head_dim + rope_dim
    query = (torch.randn(batch, heads, q_len, head_dim, generator=gen)).to(device, tdtype)
    key_cache = strided_cache(batch, num_kv, capacity, head_dim, tdtype, layout, gen, device)
    indices = make_selection(lengths, num_kv, budget, gen, fill).to(device)
    if rope_dim:
        query_rope = torch.randn(batch, heads, q_len, rope_dim, generator=gen).to(device, tdtype)
        rope_cache = strided_cache(batch, num_kv, capacity, rope_dim, tdtype, layout, gen, device)
        value_cache = key_cache
    else:
        query_rope = rope_cache = None
        value_cache = strided_cache(
            batch, num_kv, capacity, head_dim_v or head_dim, tdtype, layout, gen, device
        )
    if poison:
        for cache in {
            id(c): c for c in (key_cache, value_cache, rope_cache) if c is not None
        }.values():
            _poison(cache, indices.cpu())
    if scalar_length and len(set(lengths)) != 1:
        raise ValueError("scalar_length needs equal lengths")
    valid_length = (torch.tensor(lengths[0]) if scalar_length else torch.tensor(lengths)).to(
        device=device, dtype=torch.int64
    )
    selected = value_cache.float().nan_to_num(0.0).abs()
    options = {
        "scale": logit_scale * width**-0.5,
        "soft_cap": soft_cap,
        "sliding_window": sliding_window,
    }
    return AttentionCase(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        indices=indices,
        valid_length=valid_length,
        options=options,
        query_rope=query_rope,
        rope_cache=rope_cache,
        value_scale=float(selected.max()) if selected.numel() else 0.0,
    )
