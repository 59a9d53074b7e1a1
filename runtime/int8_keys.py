"""Key rows in 8 bits: levels and one scale per row, the form an 8-bit KV store keeps (issue 51, item 2).

A row ``x`` of ``head_dim`` values is kept as ``levels`` (int8, -127..127) and one float32
``scale = max |x| / 127``: ``x ~ levels * scale``, each entry within half a scale of ``x``
(symmetric, per batch row, KV head and token, as OpenVINO's CPU default keeps its 8-bit KV
cache). The selection kernel reads such rows
(:func:`~.cpu_selection.cpu_selection_scores` with ``key_scales``): a quarter of a float32
store's key bytes plus 4 bytes a row. ``benchmarks/kv_int8.py`` measures what an 8-bit store
keeps of the text with the same rounding (:func:`round_trip`).

Everything here is plain torch (no host read), so it traces and compiles like the step.
"""

from __future__ import annotations

import torch

__all__ = ["LEVELS", "dequantize_rows", "quantize_rows", "round_trip"]

#: largest level magnitude: 255 levels, symmetric around 0
LEVELS = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` (float32, bfloat16 or float16) as int8 ``levels`` ``[...,
    head_dim]`` and float32 ``scales`` ``[...]``: ``scale = max |x| / 127`` over the row
    (computed in float32; a row of zeros gets the smallest normal float32 over 127, levels 0),
    ``level = round(x / scale)`` (ties to even), clamped to -127..127.

    Raises:
        ValueError: ``x`` has no ``head_dim`` axis or is not a floating tensor.
    """
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"quantize_rows takes a floating tensor [..., head_dim], got {x.dtype} {tuple(x.shape)}")
    wide = x.detach().float()
    scales = wide.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / LEVELS
    levels = (wide / scales.unsqueeze(-1)).round().clamp(-LEVELS, LEVELS).to(torch.int8)
    return levels, scales


def dequantize_rows(levels: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``levels * scales`` (``[..., head_dim]`` int8 times ``[...]`` float32), computed in
    float32 and rounded to ``dtype``."""
    return (levels.float() * scales.unsqueeze(-1)).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an 8-bit store gives it back: :func:`dequantize_rows` of :func:`quantize_rows`,
    in ``x.dtype``."""
    return dequantize_rows(*quantize_rows(x), x.dtype)
