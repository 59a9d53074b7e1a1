"""Our CPU kernels (C++ sources in ``runtime/csrc``), built on first use and called as ops.

``specontext::cpu_decode_attention``: dense decode attention over a contiguous float32,
bfloat16 or float16 KV store (16-bit elements widened exactly to float32 as they are loaded), one query row per head (``csrc/decode_attention.cpp``): each KV head's keys and values
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

from .torch_private import counters

logger = logging.getLogger(__name__)

__all__ = ["STORE_DTYPES", "KernelBuildError", "applies", "available", "bf16_dot_calls", "build_library",
           "check_inputs", "cpu_decode_attention", "entry", "entry_names", "has_bf16_dot_products", "kernel_calls",
           "load_kernels", "loads", "masks_dropped", "torch_op_flags"]

_SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC",
          "-std=c++17")
_MAX_GROUP, _MAX_DIM = 16, 256  # the kernel's stack arrays (csrc/decode_attention.cpp)
#: the store dtypes our CPU kernels read (float32 accumulation), each with its entry point's suffix
_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16", torch.float16: "_fp16"}
STORE_DTYPES = tuple(_SUFFIX)
_STORE_DTYPES = STORE_DTYPES
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


#: the folder of this package's C++ sources and shared header (``cpu_common.h``): another
#: package's kernel that includes the header passes it to :func:`build_library`
CSRC = _SOURCE.parent


def torch_op_flags() -> tuple[str, ...] | None:
    """The flags that build a kernel library's torch operator kernels (``csrc/torch_op.h``,
    ``-DSPECONTEXT_TORCH_OPS``: torch's stable C ABI headers, linked against this torch), or
    None where this torch does not ship the stable headers (the Python kernels serve then)."""
    root = Path(torch.__file__).parent
    if not (root / "include" / "torch" / "csrc" / "stable" / "library.h").exists():
        return None
    lib = root / "lib"
    return ("-DSPECONTEXT_TORCH_OPS", f"-I{root / 'include'}", f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}")


def build_library(source: Path, includes: tuple[Path, ...] = (), extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build ``source`` (once per source, its headers, flags, compiler, CPU and torch version)
    into the kernel cache and load it (``ctypes``); another package's C++ kernels (the vLLM
    plugin's) build the same way, with ``includes`` (e.g. :data:`CSRC`) searched for headers
    and hashed with them. ``extra_flags``: e.g. :func:`torch_op_flags` (loading such a library
    registers its operator kernels with torch's dispatcher).

    Raises:
        KernelBuildError: no compiler on the PATH, or the build failed (its stderr included).
    """
    compiler = _compiler()
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler {compiler!r} on the PATH: install g++ (Debian: apt install g++) "
                               "or set CXX; until then the CPU step uses inductor's kernels")
    folders = (source.parent, *includes)
    code = source.read_bytes() + b"".join(h.read_bytes() for f in folders for h in sorted(f.glob("*.h")))  # its headers
    flags = (*_FLAGS, *(f"-I{f}" for f in includes), *extra_flags)
    link = tuple(f for f in flags if f.startswith(("-l", "-L", "-Wl,")))  # after the source (the linker's --as-needed)
    compile_flags = tuple(f for f in flags if f not in link)
    described = " ".join((compiler, *compile_flags, "SOURCE", *link, _cpu_flags(), torch.__version__))
    key = hashlib.sha256(code + described.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}_{key}.so"
    with _LOCK:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                cmd = [compiler, *compile_flags, str(source), *link, "-o", str(built)]
                result = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    raise KernelBuildError(f"building {source.name} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
                os.replace(built, target)  # atomic: a concurrent process sees all of it or nothing
            logger.info("specontext: built the CPU kernel %s: %s", source.name, target)
    return ctypes.CDLL(str(target))


def load_kernels(source: Path, names: tuple[str, ...], argtypes: list, op_calls: str | None = None) -> ctypes.CDLL:
    """:func:`build_library` of ``source``, its functions ``names`` (float32, bfloat16 and
    float16 entry points of one signature, :func:`entry_names`) typed: ``int`` status, ``argtypes``. With ``op_calls`` (the
    counter a kernel's calls are counted under, e.g. ``"cpu_kernel_refine_calls"``) the library
    is built with its torch operator kernel where this torch allows (:func:`torch_op_flags`;
    a failed build of that kind is logged and the plain library built instead), and its C++
    calls are counted into :func:`kernel_calls` (``specontext_<source stem>_op_calls``)."""
    lib = None
    flags = torch_op_flags() if op_calls else None
    if flags:
        try:
            lib = build_library(source, extra_flags=flags)
            counter = getattr(lib, f"specontext_{source.stem}_op_calls")
            counter.restype, counter.argtypes = ctypes.c_int64, []
            _OP_CALLS[op_calls] = counter
        except (KernelBuildError, OSError, AttributeError) as err:
            logger.warning("specontext: %s's torch operator kernel did not build (%s); its operator keeps the Python "
                           "kernel (the same arithmetic through ctypes, about 50 us more a call)", source.name, err)
            lib = None
    lib = lib or build_library(source)
    for name in names:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib


def entry_names(stem: str) -> tuple[str, ...]:
    """A kernel's entry points, one per store dtype (:data:`STORE_DTYPES`): ``stem``,
    ``stem_bf16``, ``stem_fp16``."""
    return tuple(stem + suffix for suffix in _SUFFIX.values())


def entry(lib: ctypes.CDLL, stem: str, dtype: torch.dtype):
    """The entry point of ``lib`` that reads stores of ``dtype`` (one of :data:`STORE_DTYPES`)."""
    return getattr(lib, stem + _SUFFIX[dtype])


#: counter name -> the C++ call count of a kernel's operator kernel (registered as its library loads)
_OP_CALLS: dict = {}


def kernel_calls() -> dict[str, int]:
    """Calls of our CPU kernels in this process by counter name (``cpu_kernel_attention_calls``,
    ``cpu_kernel_refine_calls``, ``cpu_kernel_selection_calls``, ``cpu_kernel_gemv_calls``): those
    through the Python kernels (``counters["specontext"]``) plus those through the C++ operator kernels."""
    names = ("cpu_kernel_attention_calls", "cpu_kernel_refine_calls", "cpu_kernel_selection_calls",
             "cpu_kernel_gemv_calls")
    return {name: counters["specontext"][name] + (_OP_CALLS[name]() if name in _OP_CALLS else 0) for name in names}


def has_bf16_dot_products() -> bool:
    """Whether this CPU has AVX-512 BF16 (``VDPBF16PS``): our kernels built for it
    (``-march=native``) compute a bfloat16 store's key logits with bfloat16 dot products."""
    return "avx512_bf16" in _cpu_flags().split()


def bf16_dot_calls(lib: ctypes.CDLL, source_stem: str) -> int:
    """Calls of the kernel library ``lib`` (source ``csrc/<source_stem>.cpp``) in this process
    that computed key logits with the CPU's bfloat16 dot products (the other calls widened the
    keys to float32 first): the path a test asserts."""
    fn = getattr(lib, f"specontext_{source_stem}_bf16_dot_calls")
    fn.restype, fn.argtypes = ctypes.c_int64, []
    return int(fn())


def masks_dropped(lib: ctypes.CDLL, source_stem: str) -> int:
    """Calls of the kernel library ``lib`` (source ``csrc/<source_stem>.cpp``) in this process
    whose visibility mask hid no written slot of any row, so the kernel ran its mask-free paths
    (``csrc/cpu_common.h``, ``needed_mask``: the compiled step passes Hugging Face's decode mask,
    which hides only the unwritten capacity): the path a test asserts."""
    fn = getattr(lib, f"specontext_{source_stem}_masks_dropped")
    fn.restype, fn.argtypes = ctypes.c_int64, []
    return int(fn())


@functools.cache
def _library() -> ctypes.CDLL:
    """The decode attention kernel library (:func:`build_library`; with the operator's C++
    kernel where this torch allows)."""
    return load_kernels(_SOURCE, entry_names("specontext_decode_attention"),
                        [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                        + [ctypes.c_int64] * 6, op_calls="cpu_kernel_attention_calls")


def loads(library, what: str, instead: str) -> bool:
    """Whether ``library()`` (a cached loader of :func:`build_library`) builds and loads here;
    if not, logs why once, naming ``what`` and what runs ``instead``."""
    try:
        library()
        return True
    except (KernelBuildError, OSError) as err:
        logger.warning("specontext: %s is not available (%s); %s", what, err, instead)
        return False


@functools.cache
def available() -> bool:
    """Whether the CPU kernel library builds and loads here (the reason logged once if not)."""
    return loads(_library, "the CPU decode attention kernel", "the CPU dense step keeps inductor's kernels")


def applies(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            attn_mask: torch.Tensor | None) -> bool:
    """Whether :func:`cpu_decode_attention` serves a dense decode site (a static fact): CPU
    query and stores of one dtype, float32, bfloat16 or float16 (the KV caches' stores are contiguous;
    another layout would be copied per call), one query row, the group and head sizes the kernel
    holds, no mask or a boolean one (an additive mask may carry a bias the kernel does not
    add), and the library available."""
    b, num_heads, q_len, head_dim = query.shape
    num_kv = key_cache.shape[1]
    return (query.device.type == "cpu" and q_len == 1 and num_heads % num_kv == 0
            and num_heads // num_kv <= _MAX_GROUP and head_dim <= _MAX_DIM
            and value_cache.shape[-1] == head_dim
            and query.dtype in _STORE_DTYPES and key_cache.dtype == value_cache.dtype == query.dtype
            and (attn_mask is None or attn_mask.dtype == torch.bool and attn_mask.shape[1] == 1)
            and available())


# A plain torch.library op, as cpu_refine_attention: its CPU kernel is C++ where the library is
# built with it (csrc/torch_op.h), else the Python kernel below (CompositeExplicitAutograd).
torch.library.define("specontext::cpu_decode_attention",
                     "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor length, Tensor? visible) -> Tensor")


def cpu_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         length: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Exact attention of one query row per head over slots ``0 .. length-1`` of the stores.

    Args:
        query: float32 ``[batch, num_heads, 1, head_dim]``, already multiplied by the softmax
            scale (paper-independent: the site's own ``scale``).
        key_cache, value_cache: float32, bfloat16 or float16 (both the same) ``[batch, num_kv_heads,
            capacity, head_dim]``
            (``num_heads`` a multiple of ``num_kv_heads``: grouped-query attention).
        length: int64 ``[]`` or ``[batch]``: tokens written, this step's included.
        visible: None or bool ``[batch|1, capacity]``: False hides a slot (left padding).

    Returns:
        float32 ``[batch, num_heads, 1, head_dim]``: softmax-weighted values, float32
        accumulation (bfloat16 stores: each element widened exactly to float32); a row that sees no slot is zeros (as SDPA's ``nan_to_num(0)`` path).

    Raises:
        KernelBuildError: the kernel library cannot be built here (see :func:`available`).
        ValueError: shapes or dtypes the kernel does not take (see :func:`applies`).
    """
    counters["specontext"]["cpu_kernel_attention_calls"] += 1
    check_inputs(query, key_cache, value_cache, length, visible)
    b, num_heads, _, head_dim = query.shape
    num_kv, capacity = key_cache.shape[1], key_cache.shape[2]
    groups = num_heads // num_kv
    if capacity == 0:  # nothing to attend to: zeros, as for a row that sees no slot
        return torch.zeros(b, num_heads, 1, head_dim, dtype=torch.float32)
    q, k, v = query.contiguous(), key_cache.contiguous(), value_cache.contiguous()
    length = length.contiguous()
    if visible is not None:
        visible = visible.reshape(-1, capacity).contiguous()
    out = torch.empty(b, num_heads, 1, head_dim, dtype=torch.float32)
    kernel = entry(_library(), "specontext_decode_attention", k.dtype)
    status = kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), length.data_ptr(), 1 if length.numel() > 1 else 0,
        visible.data_ptr() if visible is not None else None,
        capacity if visible is not None and visible.shape[0] > 1 else 0,
        out.data_ptr(), b, num_kv, groups, capacity, head_dim, 0)  # 0: the kernel's default split
    if status != 0:
        raise ValueError(f"cpu_decode_attention rejected query {tuple(query.shape)}, keys {tuple(key_cache.shape)}")
    return out


def check_inputs(query, key_cache, value_cache, length, visible, op: str = "cpu_decode_attention") -> None:
    """What :func:`cpu_decode_attention` (or another of our kernels, ``op``, over the same
    query, stores, length and visibility) reads, checked before the C++ kernel reads raw
    memory: a ValueError naming the argument, never a read out of bounds or bytes of another dtype."""
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    for name, t in tensors.items():
        dtypes = (torch.float32,) if name == "query" else _STORE_DTYPES
        if t.dim() != 4 or t.dtype not in dtypes or t.device.type != "cpu":
            kind = "float32" if name == "query" else "float32, bfloat16 or float16"
            raise ValueError(f"{op}: {name} must be a 4-d {kind} CPU tensor, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"{op}: key_cache ({key_cache.dtype}) and value_cache "
                         f"({value_cache.dtype}) must have one dtype")
    b, num_heads, q_len, head_dim = query.shape
    kb, num_kv, capacity, kd = key_cache.shape
    if tuple(value_cache.shape) != tuple(key_cache.shape):
        raise ValueError(f"{op}: value_cache {tuple(value_cache.shape)} must have the key "
                         f"store's shape {tuple(key_cache.shape)}")
    if kb != b or kd != head_dim or num_kv == 0 or num_heads % num_kv:
        raise ValueError(f"{op}: keys {tuple(key_cache.shape)} must have the query's batch "
                         f"({b}) and head_dim ({head_dim}), and a number of KV heads dividing its {num_heads} heads")
    if q_len != 1 or num_heads // num_kv > _MAX_GROUP or head_dim > _MAX_DIM:
        raise ValueError(f"{op} takes one query row, at most {_MAX_GROUP} query heads per KV "
                         f"head and head_dim <= {_MAX_DIM}; got query {tuple(query.shape)}, keys {tuple(key_cache.shape)}")
    for name, t in (("length", length), ("visible", visible)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{op}: {name} must be a CPU tensor, got one on {t.device}")
    if length.dtype != torch.int64 or length.numel() not in (1, b):
        raise ValueError(f"{op}: length must be int64 with 1 or {b} entries, got "
                         f"{length.dtype} {tuple(length.shape)}")
    if visible is not None and (visible.dtype != torch.bool or visible.shape[-1] != capacity
                                or visible.numel() not in (capacity, b * capacity)):
        raise ValueError(f"{op}: visible must be bool [1 or {b}, {capacity}] (leading dims "
                         f"of size 1 allowed), got {visible.dtype} {tuple(visible.shape)}")


torch.library.impl("specontext::cpu_decode_attention", "CompositeExplicitAutograd")(cpu_decode_attention)


@torch.library.register_fake("specontext::cpu_decode_attention")
def _(query, key_cache, value_cache, length, visible):
    return query.new_empty(query.shape)
