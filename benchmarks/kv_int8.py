"""An 8-bit KV store, emulated, for fidelity runs (issue 51, item 2: does an 8-bit KV store
keep the agreement before we build one?).

Every key and value row written to the store is rounded to 8 bits with its own scale
(symmetric, per batch row, KV head and token: ``scale = max |x| / 127`` over ``head_dim``;
OpenVINO's CPU default also keeps one scale per token) and written back dequantized in the
store's dtype. Selection, refinement and attention then read exactly the values an int8
store with per-token scales would give them (up to one rounding to the store's dtype), so
agreement and NLL measured with it are those of such a store; bytes and speed are not (the
store still holds the model's dtype).

Applied by replacing :func:`specontext_compile.runtime.aten_step.write_kv` (the body of every
``specontext::kv_write``, eager and lowered) for the duration of a ``with`` block, before the
model is compiled. Page bounds follow: they are recomputed from the store after each write
(``page_bounds.update_after_write``), so they bound the rounded keys.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.fx.node import has_side_effect

from specontext_compile.runtime import aten_step, int8_keys

__all__ = ["int8_kv_store", "int8_round_trip", "write_kv_int8"]


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[batch, num_kv_heads, q_len, head_dim]`` rounded to int8 with one symmetric scale
    per row of ``head_dim`` (``max |x| / 127``, computed in float32) and dequantized to
    ``x.dtype`` (:func:`~specontext_compile.runtime.int8_keys.round_trip`, the rows the
    selection kernel's int8 entry reads). A row of zeros stays zeros. Largest error per entry:
    half a scale."""
    return int8_keys.round_trip(x)


#: the plain write, kept while :func:`int8_kv_store` has replaced it
_PLAIN_WRITE = aten_step.write_kv


@has_side_effect
def write_kv_int8(key_cache, value_cache, length, key, value, checked=None):
    """:func:`~specontext_compile.runtime.aten_step.write_kv` of int8-rounded rows."""
    _PLAIN_WRITE(key_cache, value_cache, length, int8_round_trip(key), int8_round_trip(value), checked)


@contextlib.contextmanager
def int8_kv_store() -> Iterator[None]:
    """Inside the block, every KV write (``aten_step.write_kv``) stores int8-rounded keys and
    values (:func:`int8_round_trip`). Compile inside the block: a step lowered outside it
    keeps the plain write. Restores the plain write on exit, also on an error."""
    aten_step.write_kv = write_kv_int8
    try:
        yield
    finally:
        aten_step.write_kv = _PLAIN_WRITE
