"""Our CPU kernels (C++ sources in ``runtime/csrc``), built on first use and called as ops.

``specontext::cpu_decode_attention``: dense decode attention over a contiguous float32 KV
store, one query row per head (``csrc/decode_attention.cpp``): each KV head's keys and values
are loaded once for all the query heads of its group, with an online softmax, and the slots
are split between the threads. Inductor's fused code for the same attention
(:mod:`.split_store`) loads each key once per query row and ends each dot product with a
horizontal sum; this kernel is what the backend's CPU dense step calls where it applies
(:func:`applies`).

Build: ``g++ -O3 -march=native -fopenmp -shared -fPIC`` (the compiler inductor uses: ``CXX``,
else ``g++``) into ``$SPECONTEXT_KERNEL_CACHE`` (default ``~/.cache/specontext/kernels``), one
shared library per source, flags and compiler (their hash in the file name), loaded with
``ctypes``. Built once per machine (a few seconds; the CPU's flags are part of the key); a failed build raises :class:`KernelBuildError`
naming the compiler and the fix, and :func:`available` reports it so the caller keeps the
inductor path (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch._dynamo.utils import counters

logger = logging.getLogger(__name__)

__all__ = ["KernelBuildError", "applies", "available", "cpu_decode_attention", "cpu_refine_attention", "decode_splits",
           "refine_applies", "refine_splits"]

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = (_CSRC / "decode_attention.cpp", _CSRC / "refine_attention.cpp")
_HEADERS = (_CSRC / "vector_math.h",)
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC",
          "-std=c++17")
_MAX_GROUP, _MAX_DIM = 16, 256  # the kernel's stack arrays (csrc/decode_attention.cpp)
_LOCK = threading.Lock()


class KernelBuildError(RuntimeError):
    """A CPU kernel could not be built (no C++ compiler, or it failed)."""


def _compiler() -> str:
    return os.environ.get("CXX") or "g++"


def _cache_dir() -> Path:
    root = os.environ.get("SPECONTEXT_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "specontext" / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them: a cache folder shared by
    machines with other CPUs gets a library per CPU), or the machine name off Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


@functools.cache
def _library() -> ctypes.CDLL:
    """Build (once per source, flags and compiler) and load the kernel library.

    Raises:
        KernelBuildError: no compiler on the PATH, or the build failed (its stderr included).
    """
    compiler = _compiler()
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler {compiler!r} on the PATH: install g++ (Debian: apt install g++) "
                               "or set CXX; until then the CPU step uses inductor's kernels")
    source = b"".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    key = hashlib.sha256(source + " ".join((compiler, *_FLAGS, _cpu_flags())).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels_{key}.so"
    with _LOCK:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                cmd = [compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(built)]
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    raise KernelBuildError(f"building the CPU kernels failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
                os.replace(built, target)  # atomic: a concurrent process sees all of it or nothing
            logger.info("specontext: built the CPU kernels: %s", target)
    lib = ctypes.CDLL(str(target))
    fn = lib.specontext_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                   + [ctypes.c_int64] * 6)
    fn = lib.specontext_refine_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                   + [ctypes.c_int64] * 10)
    return lib


@functools.cache
def available() -> bool:
    """Whether the CPU kernel library builds and loads here (the reason logged once if not)."""
    try:
        _library()
        return True
    except (KernelBuildError, OSError) as err:
        logger.warning("specontext: the CPU decode attention kernel is not available (%s); "
                       "the CPU dense step keeps inductor's kernels", err)
        return False


def decode_splits(rows: int, capacity: int) -> int:
    """Work items per ``batch * num_kv_heads`` row: the slots are split so that there are at
    least 32 items for the threads (11 splits for SmolLM2's 3 KV heads at batch 1), each of
    at least 256 slots (fewer splits for a short store)."""
    return max(1, min(-(-32 // max(rows, 1)), capacity // 256))


def applies(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            attn_mask: torch.Tensor | None) -> bool:
    """Whether :func:`cpu_decode_attention` serves a dense decode site (a static fact): CPU
    float32 query and stores (the KV caches' stores are contiguous; another layout would be
    copied per call), one query row, the group and head sizes the kernel
    holds, no mask or a boolean one (an additive mask may carry a bias the kernel does not
    add), and the library available."""
    b, num_heads, q_len, head_dim = query.shape
    num_kv = key_cache.shape[1]
    return (query.device.type == "cpu" and q_len == 1 and num_heads % num_kv == 0
            and num_heads // num_kv <= _MAX_GROUP and head_dim <= _MAX_DIM
            and value_cache.shape[-1] == head_dim
            and all(t.dtype == torch.float32 for t in (query, key_cache, value_cache))
            and (attn_mask is None or attn_mask.dtype == torch.bool and attn_mask.shape[1] == 1)
            and available())


@torch.library.custom_op("specontext::cpu_decode_attention", mutates_args=())
def cpu_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         length: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Exact attention of one query row per head over slots ``0 .. length-1`` of the stores.

    Args:
        query: float32 ``[batch, num_heads, 1, head_dim]``, already multiplied by the softmax
            scale (paper-independent: the site's own ``scale``).
        key_cache, value_cache: float32 ``[batch, num_kv_heads, capacity, head_dim]``
            (``num_heads`` a multiple of ``num_kv_heads``: grouped-query attention).
        length: int64 ``[]`` or ``[batch]``: tokens written, this step's included.
        visible: None or bool ``[batch|1, capacity]``: False hides a slot (left padding).

    Returns:
        float32 ``[batch, num_heads, 1, head_dim]``: softmax-weighted values, float32
        accumulation; a row that sees no slot is zeros (as SDPA's ``nan_to_num(0)`` path).

    Raises:
        KernelBuildError: the kernel library cannot be built here (see :func:`available`).
        ValueError: shapes or dtypes the kernel does not take (see :func:`applies`).
    """
    counters["specontext"]["cpu_kernel_attention_calls"] += 1
    _check_inputs(query, key_cache, value_cache, length, visible)
    b, num_heads, _, head_dim = query.shape
    num_kv, capacity = key_cache.shape[1], key_cache.shape[2]
    groups = num_heads // num_kv
    q, k, v = query.contiguous(), key_cache.contiguous(), value_cache.contiguous()
    length = length.contiguous()
    if visible is not None:
        visible = visible.reshape(-1, capacity).contiguous()
    out = torch.empty(b, num_heads, 1, head_dim, dtype=torch.float32)
    status = _library().specontext_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), length.data_ptr(), 1 if length.numel() > 1 else 0,
        visible.data_ptr() if visible is not None else None,
        capacity if visible is not None and visible.shape[0] > 1 else 0,
        out.data_ptr(), b, num_kv, groups, capacity, head_dim, decode_splits(b * num_kv, capacity))
    if status != 0:
        raise ValueError(f"cpu_decode_attention rejected query {tuple(query.shape)}, keys {tuple(key_cache.shape)}")
    return out


def _check_inputs(query, key_cache, value_cache, length, visible, name: str = "cpu_decode_attention") -> None:
    """What the kernel ``name`` (:func:`cpu_decode_attention`, :func:`cpu_refine_attention`) reads, checked before the C++ kernel reads raw memory:
    a ValueError naming the argument, never a read out of bounds or bytes of another dtype."""
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    for name, t in tensors.items():
        if t.dim() != 4 or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name}: {name} must be a 4-d float32 CPU tensor, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    b, num_heads, q_len, head_dim = query.shape
    kb, num_kv, capacity, kd = key_cache.shape
    if tuple(value_cache.shape) != tuple(key_cache.shape):
        raise ValueError(f"{name}: value_cache {tuple(value_cache.shape)} must have the key "
                         f"store's shape {tuple(key_cache.shape)}")
    if kb != b or kd != head_dim or num_kv == 0 or num_heads % num_kv:
        raise ValueError(f"{name}: keys {tuple(key_cache.shape)} must have the query's batch "
                         f"({b}) and head_dim ({head_dim}), and a number of KV heads dividing its {num_heads} heads")
    if q_len != 1 or num_heads // num_kv > _MAX_GROUP or head_dim > _MAX_DIM:
        raise ValueError(f"{name} takes one query row, at most {_MAX_GROUP} query heads per KV "
                         f"head and head_dim <= {_MAX_DIM}; got query {tuple(query.shape)}, keys {tuple(key_cache.shape)}")
    if length.dtype != torch.int64 or length.numel() not in (1, b):
        raise ValueError(f"{name}: length must be int64 with 1 or {b} entries, got "
                         f"{length.dtype} {tuple(length.shape)}")
    if visible is not None and (visible.dtype != torch.bool or visible.shape[-1] != capacity
                                or visible.numel() not in (capacity, b * capacity)):
        raise ValueError(f"{name}: visible must be bool [1 or {b}, {capacity}] (leading dims "
                         f"of size 1 allowed), got {visible.dtype} {tuple(visible.shape)}")


@cpu_decode_attention.register_fake
def _(query, key_cache, value_cache, length, visible):
    return query.new_empty(query.shape)


def refine_splits(items: int, slots: int) -> int:
    """Work items per ``batch * num_kv_heads`` item of :func:`cpu_refine_attention`: 1 (an item
    per thread) when there are at least twice as many items as threads, else the candidates
    are split so that every thread has two work items (2 splits for SmolLM2's 3 KV heads at
    batch 1 on 2 threads), each of at least 256 candidates."""
    threads = torch.get_num_threads()
    if items >= 2 * threads:
        return 1
    return max(1, min(-(-2 * threads // max(items, 1)), slots // 256))


def refine_applies(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   attn_mask: torch.Tensor | None) -> bool:
    """Whether :func:`cpu_refine_attention` serves a refined site's decode step (a static
    fact): the conditions of :func:`applies` (one float32 query row per head, the group and
    head sizes the kernels hold, no mask or a boolean one with one head, the library
    available); the caller also needs a plain variant (scale only)."""
    return applies(query, key_cache, value_cache, attn_mask)


@torch.library.custom_op("specontext::cpu_refine_attention", mutates_args=())
def cpu_refine_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         candidates: torch.Tensor, length: torch.Tensor, visible: torch.Tensor | None,
                         budget: int, sinks: int, recent: int) -> torch.Tensor:
    """The refinement of the two-stage selection and the attention over what it keeps, for one
    query row per head (the CPU body of :func:`~.aten_step.refine_and_attend`; the same
    ranking as :func:`~.aten_step.ranked`, SpeContext section 4's GQA rule).

    Per batch row and KV head, the group's query rows score each candidate's key (read in
    place from the store); a candidate's rank is the largest softmax weight (among the
    candidates) a query head of the group gives it; the first ``sinks`` valid candidates (in
    the candidates' order) and the positions ``>= length - recent`` rank first; the ``budget``
    best are kept (ties broken arbitrarily) and the output is the softmax over the kept
    candidates' logits times their values.

    Args:
        query: float32 ``[batch, num_heads, 1, head_dim]``, already multiplied by the softmax scale.
        key_cache, value_cache: float32 ``[batch, num_kv_heads, capacity, head_dim]``.
        candidates: int64 ``[batch, num_kv_heads, slots]``: store positions, ``-1`` = none
            (a position at or past ``capacity`` is treated as hidden, never read).
        length: int64 ``[]`` or ``[batch]``: tokens written, this step's included (the
            causal limit: positions ``< length`` are seen).
        visible: None or bool ``[batch|1, capacity]``: False hides a position (left padding).
        budget: candidates kept (``>= 0``; all of them when ``>= slots``).
        sinks, recent: the forced candidates, as :func:`~.aten_step.ranked` computes them.

    Returns:
        float32 ``[batch, num_heads, 1, head_dim]``; a row that sees no kept candidate is zeros.

    Raises:
        KernelBuildError: the kernel library cannot be built here (see :func:`available`).
        ValueError: shapes or dtypes the kernel does not take (see :func:`refine_applies`).
    """
    counters["specontext"]["cpu_kernel_refine_calls"] += 1
    _check_inputs(query, key_cache, value_cache, length, visible, "cpu_refine_attention")
    b, num_heads, _, head_dim = query.shape
    num_kv, capacity = key_cache.shape[1], key_cache.shape[2]
    if candidates.dtype != torch.int64 or candidates.dim() != 3 or tuple(candidates.shape[:2]) != (b, num_kv):
        raise ValueError(f"cpu_refine_attention: candidates must be int64 [{b}, {num_kv}, slots], got "
                         f"{candidates.dtype} {tuple(candidates.shape)}")
    if candidates.shape[2] < 1 or budget < 0:
        raise ValueError(f"cpu_refine_attention: needs at least one candidate slot and budget >= 0, got "
                         f"{candidates.shape[2]} slots, budget {budget}")
    q, k, v = query.contiguous(), key_cache.contiguous(), value_cache.contiguous()
    cand, length = candidates.contiguous(), length.contiguous()
    if visible is not None:
        visible = visible.reshape(-1, capacity).contiguous()
    out = torch.empty(b, num_heads, 1, head_dim, dtype=torch.float32)
    status = _library().specontext_refine_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), cand.data_ptr(), length.data_ptr(), 1 if length.numel() > 1 else 0,
        visible.data_ptr() if visible is not None else None,
        capacity if visible is not None and visible.shape[0] > 1 else 0,
        out.data_ptr(), b, num_kv, num_heads // num_kv, capacity, head_dim, cand.shape[2], budget, sinks, recent,
        refine_splits(b * num_kv, cand.shape[2]))
    if status != 0:
        raise ValueError(f"cpu_refine_attention rejected query {tuple(query.shape)}, keys {tuple(key_cache.shape)}")
    return out


@cpu_refine_attention.register_fake
def _(query, key_cache, value_cache, candidates, length, visible, budget, sinks, recent):
    return query.new_empty(query.shape)
