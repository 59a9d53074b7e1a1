"""The selection's 8-bit copy of the retrieval layers' keys (option ``selection_keys="int8"``, issue 51).

Once per decode step the lagged-query head scores every written token of the retrieval layers
(SpeContext section 4): at 32K tokens and 8 retrieval layers of SmolLM2 that reads 201 MB of
float32 keys a step, a fifth of what the default step must read. A store created with
``mirror_keys`` also keeps its keys as int8 levels and one float32 scale a row
(:mod:`.int8_keys`: 68 bytes a row at head_dim 64, against 256 in float32 and 128 in bfloat16),
and the selection's CPU kernel reads those instead (:func:`.cpu_selection.lagged_scores` with
``mirrors``). The KV stores
themselves are untouched: attention, refinement and page bounds read the model's keys.

State, per store (:class:`~.kv_cache.SpeContextLayer`), kept like its page bounds:

* ``key_levels`` int8 ``[batch, num_kv_heads, capacity, head_dim]``;
* ``key_scales`` float32 ``[batch, num_kv_heads, capacity]``.

Invariants:

* **Written with the keys.** Every ``specontext::kv_write`` (prefill and decode, eager and
  lowered) writes the int8 rows of the keys it writes (:func:`write_rows`), so positions
  ``< length`` are always current; a crop's dropped rows are never read and are rewritten by
  the next write there; a row reorder or a batch change moves them with the stores.
* **Exactly the rounding of** :func:`.int8_keys.quantize_rows` (torch ops, static shapes).
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from . import int8_keys

__all__ = ["DEFAULT_SELECTION_KEYS", "SELECTION_KEYS", "allocate", "applies", "write_rows"]

#: what the lagged-query selection reads: the KV stores' keys, or their int8 copy
SELECTION_KEYS = ("store", "int8")
#: the default of the option and of :class:`~.kv_cache.SpeContextCache` (one source for both)
DEFAULT_SELECTION_KEYS = "int8"


def allocate(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed ``(key_levels, key_scales)`` for a store ``keys`` ``[batch, num_kv_heads,
    capacity, head_dim]``."""
    return (torch.zeros(keys.shape, dtype=torch.int8, device=keys.device),
            torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device))


@has_side_effect
def write_rows(key_cache: torch.Tensor, key_mirror: list[torch.Tensor], length: torch.Tensor, key: torch.Tensor,
               checked: torch.Tensor | None = None) -> None:
    """The int8 half of ``specontext::kv_write``: after ``key`` ``[batch, num_kv_heads, q_len,
    head_dim]`` was written into ``key_cache`` ``[batch, num_kv_heads, capacity, head_dim]`` at
    positions ``length - q_len .. length - 1`` (``length``: int64 scalar, tokens written
    including this write's), the rows (:func:`.int8_keys.quantize_rows`) of the keys *as stored*
    (read back from ``key_cache``) into ``key_mirror`` = ``[key_levels, key_scales]`` (``[]``:
    the store keeps none). Read back, not taken from ``key``: in a compiled bfloat16 or float16
    step inductor may hand the float32 value it computed before rounding it into the store, and
    the rows then differed from the stored keys' by a level. Static shapes, no host read.
    ``checked``: the int64 zero of
    ``specontext::check_capacity``, added to the positions as :func:`.aten_step.write_kv` adds
    it, so that a compiled step writes no row before the capacity check has passed (layer 0's
    keys do not otherwise depend on it: an out-of-range row aborted in inductor's bounds check)."""
    if not key_mirror:
        return
    levels, scales = key_mirror
    q_len = key.shape[-2]
    pos = length.to(levels.device) - q_len + torch.arange(q_len, device=levels.device)
    if checked is not None:
        pos = pos + checked.to(levels.device)
    rows, row_scales = int8_keys.quantize_rows(key_cache.index_select(2, pos.to(key_cache.device)))
    levels.index_copy_(2, pos, rows.to(levels.device))
    scales.index_copy_(2, pos, row_scales.to(scales.device))


def applies(mirrors: list, stores: list) -> bool:
    """Whether ``mirrors`` (one ``(key_levels, key_scales)`` per store, example values) serve
    the CPU selection kernel over ``stores``: CPU tensors of the stores' shapes."""
    if len(mirrors) != len(stores) or not stores:
        return False
    for mirror, store in zip(mirrors, stores):
        if len(mirror) != 2 or not isinstance(store, torch.Tensor) or any(m is None for m in mirror):
            return False
        levels, scales = mirror
        if (levels.dtype != torch.int8 or scales.dtype != torch.float32 or levels.device.type != "cpu"
                or tuple(levels.shape) != tuple(store.shape) or tuple(scales.shape) != tuple(store.shape[:3])):
            return False
    return True
