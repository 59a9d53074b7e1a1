"""The host side of the Triton kernels (``codegen/kernels.py``): load them, specialise them by a
:class:`~.spec.KernelSpec`, launch them (issue 53, item 3).

A spec becomes ``tl.constexpr`` arguments (:func:`split_constexprs`); Triton compiles one
binary per distinct set and caches it itself (in memory per ``JITFunction``, on disk under
``~/.triton/cache``), so nothing here generates or caches code.

``kernels.py`` is loaded once per Triton mode (:func:`kernel_module`): ``@triton.jit``
decides when it decorates whether a function is compiled or interpreted
(``TRITON_INTERPRET=1``, read at that moment), and the file's reductions differ between the
two. Both loads are the same file; neither is registered in ``sys.modules``. Nothing here
sets ``TRITON_INTERPRET``: a process (or test) that wants the other mode sets it first.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from pathlib import Path
from types import ModuleType

from .spec import KernelSpec, next_power_of_2

__all__ = ["interpreter_enabled", "kernel_module", "launch", "split_constexprs", "split_kernel_name",
           "triton_available"]

logger = logging.getLogger(__name__)

KERNELS_FILE = Path(__file__).with_name("kernels.py")


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    """Whether the Triton kernels can run here: triton imports and either a CUDA device is
    present (compiled kernels) or ``TRITON_INTERPRET=1`` is set (interpreter on CPU tensors).
    Never raises."""
    if not _triton_importable():
        return False
    if interpreter_enabled():
        return True
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken CUDA setups
        logger.debug("torch.cuda.is_available() failed", exc_info=True)
        return False


@functools.cache
def _load(interpreted: bool) -> ModuleType:
    name = f"{__package__}.kernels_{'interpreted' if interpreted else 'compiled'}"
    module_spec = importlib.util.spec_from_file_location(name, KERNELS_FILE)
    if module_spec is None or module_spec.loader is None:  # pragma: no cover
        raise ImportError(f"cannot load the Triton kernels from {KERNELS_FILE}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    logger.info("loaded %s (interpreter=%s)", KERNELS_FILE, interpreted)
    return module


def kernel_module() -> ModuleType:
    """``codegen/kernels.py`` loaded for the current Triton mode (:func:`interpreter_enabled`,
    read now); the same module object for the same mode.

    Raises:
        ImportError: when triton is not installed.
        RuntimeError: under the interpreter with triton older than
            :data:`INTERPRETER_MIN_TRITON` (its interpreter cannot run the kernels' split loops).
    """
    if not _triton_importable():
        raise ImportError("the Triton kernels need triton: pip install 'specontext-compile[triton]' "
                          "(or use the torch path of specontext_compile.runtime)")
    interpreted = interpreter_enabled()
    if interpreted:
        check_interpreter_version()
    return _load(interpreted)


# Triton 3.6's interpreter gives tl.program_id a one-element array, and ``range()`` over a
# bound made from it raises "only 0-dimensional arrays can be converted to Python scalars";
# 3.7, 3.8 and 3.9 run the kernels (checked 2026-12-06). Compiled kernels are unaffected: the
# device image's triton 3.6 compiles them (docs/gpu.md).
INTERPRETER_MIN_TRITON = (3, 7)


def check_interpreter_version(version: str | None = None) -> None:
    """Raise when the installed triton's interpreter (or ``version``'s) cannot run the kernels.

    Raises:
        RuntimeError: triton older than :data:`INTERPRETER_MIN_TRITON`, naming the fix.
    """
    if version is None:
        import triton

        version = triton.__version__
    from packaging.version import InvalidVersion, Version

    try:
        parts = Version(version).release[:2]
    except InvalidVersion:
        raise RuntimeError(f"cannot read triton's version {version!r}; TRITON_INTERPRET=1 needs triton >= "
                           f"{'.'.join(map(str, INTERPRETER_MIN_TRITON))}") from None
    if parts < INTERPRETER_MIN_TRITON:
        need = ".".join(map(str, INTERPRETER_MIN_TRITON))
        raise RuntimeError(f"TRITON_INTERPRET=1 needs triton >= {need} to run the kernels on CPU "
                           f"(triton {version}'s interpreter cannot loop over a program id): "
                           f"pip install 'triton>={need}', or unset TRITON_INTERPRET and use "
                           "kernel='torch' on CPU")


def split_kernel_name(spec: KernelSpec) -> str:
    """Name of ``spec``'s phase-1 kernel in ``kernels.py``."""
    return "sparse_mla_split_kernel" if spec.is_mla else "sparse_decode_split_kernel"


def split_constexprs(spec: KernelSpec, interpreted: bool = False) -> dict:
    """The ``tl.constexpr`` arguments of ``spec``'s phase-1 kernel: sizes, flags and the dot's
    precision (``DOT_IEEE`` for fp32 storage; ``DOT_UPCAST`` for bf16 under the interpreter)."""
    widths = (dict(HEAD_DIM=spec.head_dim, ROPE_DIM=spec.rope_dim, BLOCK_D=spec.block_d, BLOCK_R=spec.block_r)
              if spec.is_mla else
              dict(HEAD_DIM=spec.head_dim, HEAD_DIM_V=spec.head_dim_v, BLOCK_D=spec.block_d,
                   BLOCK_DV=spec.block_dv))
    return {**widths, "GROUP": spec.group, "Q_LEN": spec.q_len, "ROW_TILES": spec.row_tiles,
            "BLOCK_M": spec.block_m, "BLOCK_N": spec.block_n, "HAS_SOFT_CAP": spec.soft_cap,
            "HAS_WINDOW": spec.sliding_window, "DOT_IEEE": spec.dtype == "fp32",
            "DOT_UPCAST": interpreted and spec.dtype == "bf16"}


def _strides(prefix: str, tensor, names: str) -> dict:
    return {f"{prefix}_stride_{n}": tensor.stride(i) for i, n in enumerate(names)}


def launch(spec: KernelSpec, tensors: tuple, indices, valid_length, out, part_out, part_lse, *,
           scale: float, soft_cap: float, window: int, split_size: int, num_splits: int, wrap=None):
    """Run both phases for ``spec`` (inputs validated by :mod:`.attention`).

    Args:
        spec: the call's :class:`KernelSpec`.
        tensors: ``(query, key_cache, value_cache)``; MLA: ``(query, query_rope,
            latent_cache, rope_cache)``.
        indices: int64 ``[batch, num_kv_heads, budget]``, ``-1`` = padding.
        valid_length: int64 ``[batch]`` (stride 0 allowed).
        out: ``[batch, heads, q_len, head_dim_v]`` in the spec's dtype, written.
        part_out, part_lse: fp32 scratch ``[batch, heads, q_len, num_splits, head_dim_v]`` and
            ``[batch, heads, q_len, num_splits]``.
        scale, soft_cap, window: softmax scale, soft cap (used with ``spec.soft_cap``), window
            in tokens (used with ``spec.sliding_window``).
        split_size, num_splits: the flash-decoding split (:func:`.attention.choose_splits`).
        wrap: applied to each kernel before its launch (``torch.library.wrap_triton`` inside a
            ``triton_op``, so that torch.compile sees the kernels); None launches them as
            they are.

    Returns:
        ``out``.
    """
    interpreted = interpreter_enabled()
    module = kernel_module()
    split_kernel, merge_kernel = getattr(module, split_kernel_name(spec)), module.sparse_decode_merge_kernel
    if wrap is not None:
        split_kernel, merge_kernel = wrap(split_kernel), wrap(merge_kernel)
    batch, num_heads = out.shape[0], out.shape[1]
    if spec.is_mla:
        query, query_rope, key_cache, rope_cache = tensors
        pointers = dict(q_ptr=query, qr_ptr=query_rope, k_ptr=key_cache, kr_ptr=rope_cache)
        strides = {**_strides("q", query, "bhtd"), **_strides("qr", query_rope, "bhtd"),
                   **_strides("k", key_cache, "bhcd"), **_strides("kr", rope_cache, "bhcd")}
    else:
        query, key_cache, value_cache = tensors
        pointers = dict(q_ptr=query, k_ptr=key_cache, v_ptr=value_cache)
        strides = {**_strides("q", query, "bhtd"), **_strides("k", key_cache, "bhcd"),
                   **_strides("v", value_cache, "bhcd")}
    partials = {**_strides("po", part_out, "bhtsd"), **_strides("pl", part_lse, "bhts")}
    split_kernel[(batch, num_heads // spec.group * spec.row_tiles, num_splits)](
        **pointers, idx_ptr=indices, vlen_ptr=valid_length, part_out_ptr=part_out, part_lse_ptr=part_lse,
        **strides, **_strides("idx", indices, "bhn"), vlen_stride_b=valid_length.stride(0), **partials,
        budget=indices.shape[2], split_size=split_size, scale=scale, soft_cap=soft_cap, window=window,
        **split_constexprs(spec, interpreted), num_warps=spec.num_warps, num_stages=spec.num_stages,
    )
    merge_kernel[(batch, num_heads, spec.q_len)](
        part_out_ptr=part_out, part_lse_ptr=part_lse, out_ptr=out, **partials,
        **_strides("out", out, "bhtd"), num_splits=num_splits,
        HEAD_DIM_V=spec.head_dim_v, BLOCK_DV=spec.block_dv, BLOCK_S=next_power_of_2(num_splits),
        num_warps=4,
    )
    return out
