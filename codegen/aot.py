"""Ahead-of-time compilation of generated kernels for an NVIDIA target, without a GPU.

Triton compiles to PTX and cubin without a driver when given an explicit ``GPUTarget``; the
wheel ships ``ptxas``. This lets CPU-only CI check that every generated kernel really builds
for Hopper (sm_90a) and report its registers, spills and shared memory, before a GPU is lent.

The argument types are those Triton would specialise at launch time: :func:`.launch.launch`
is run on ``meta`` tensors (no memory) with each kernel wrapped in a recorder (its ``wrap``); each recorded call becomes an ``ASTSource`` signature
(tensor -> ``*dtype``, int -> ``i32``/``i64`` by value or a constant when equal to 1, float ->
``fp32``, ``tl.constexpr`` parameters -> constants, divisibility-by-16 hints as at launch).

Must run where ``TRITON_INTERPRET`` is unset (jit functions, not interpreted ones); the CLI
``python -m specontext_compile.codegen compile`` does so.
"""

from __future__ import annotations

import logging
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from .launch import interpreter_enabled, launch
from .spec import KernelSpec

__all__ = ["KernelBuild", "compile_for_target"]

logger = logging.getLogger(__name__)

_PTR_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
}


@dataclass(frozen=True)
class KernelBuild:
    """Resources of one kernel compiled for one target.

    Attributes:
        name: kernel function name. arch: compute capability (e.g. 90).
        registers: 32-bit registers per thread (ptxas), -1 if unknown.
        spill_bytes: spill stores + loads in bytes (ptxas), -1 if unknown.
        shared_bytes: dynamic shared memory per program (Triton metadata).
        num_warps: warps per program.
    """

    name: str
    arch: int
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](**kwargs)`` records the call."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda **kwargs: self.calls.append((self.kernel, grid, kwargs))


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _fake_launch_args(
    spec: KernelSpec, batch: int, num_kv: int, capacity: int, num_splits: int
) -> tuple[tuple, tuple, dict]:
    """Meta tensors shaped like a real decode step of ``spec``: the attention inputs, then
    ``(indices, valid_length, out, part_out, part_lse)``, then the keyword arguments."""
    dt = spec.torch_dtype
    heads = num_kv * spec.group
    q_len, budget = spec.q_len, 2048
    tensors = [_meta((batch, heads, q_len, spec.head_dim), dt)]
    if spec.is_mla:
        tensors += [
            _meta((batch, heads, q_len, spec.rope_dim), dt),
            _meta((batch, num_kv, capacity, spec.head_dim), dt),
            _meta((batch, num_kv, capacity, spec.rope_dim), dt),
        ]
    else:
        tensors += [
            _meta((batch, num_kv, capacity, spec.head_dim), dt),
            _meta((batch, num_kv, capacity, spec.head_dim_v), dt),
        ]
    tail = (
        _meta((batch, num_kv, budget), torch.int64),
        _meta((batch,), torch.int64),
        _meta((batch, heads, q_len, spec.head_dim_v), dt),
        _meta((batch, heads, q_len, num_splits, spec.head_dim_v), torch.float32),
        _meta((batch, heads, q_len, num_splits), torch.float32),
    )
    return tuple(tensors), tail, {
        "scale": 0.1,
        "soft_cap": 30.0,
        "window": 128,
        "split_size": budget // num_splits,
        "num_splits": num_splits,
    }


def _record_calls(spec, batch: int, num_kv: int, capacity: int, num_splits: int) -> list:
    calls: list = []
    tensors, tail, kwargs = _fake_launch_args(spec, batch, num_kv, capacity, num_splits)
    launch(spec, tensors, *tail, **kwargs, wrap=lambda kernel: _Recorder(kernel, calls))
    return calls


def _signature(kernel, kwargs: dict) -> tuple[dict, dict, dict]:
    """Signature, constants and divisibility hints as Triton's launcher specialises them:
    an int equal to 1 becomes a constant, ints divisible by 16 and (16-byte aligned)
    pointers get ``tt.divisibility=16``."""
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = kwargs[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _PTR_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int) and value == 1:
            signature[param.name], constants[param.name] = "constexpr", 1
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    return signature, constants, attrs


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes) from ``ptxas -v``; (-1, -1) when ptxas is unavailable."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except (ImportError, AttributeError, RuntimeError):  # pragma: no cover - no nvidia backend
        return -1, -1
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        proc = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu}", src.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=False,
        )
    log = proc.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return (int(regs.group(1)) if regs else -1), sum(spills) if spills else -1


def compile_for_target(
    spec: KernelSpec,
    arch: int = 90,
    *,
    batch: int = 4,
    num_kv: int = 8,
    capacity: int = 131072,
    num_splits: int = 8,
) -> list[KernelBuild]:
    """Compile every kernel of ``spec`` for ``cuda:sm_<arch>`` (no GPU needed).

    Args:
        spec: the kernel spec. arch: compute capability (90 = Hopper).
        batch, num_kv, capacity, num_splits: shapes of the fake launch (they set the strides
            and hence whether Triton would pass them as i32 or i64).

    Returns:
        One ``KernelBuild`` per kernel launched by the spec's ``launch``.

    Raises:
        RuntimeError: under ``TRITON_INTERPRET=1`` (interpreted functions cannot compile).
        triton.CompilationError (or subclasses): when generated code does not build.
    """
    if interpreter_enabled():
        raise RuntimeError("compile_for_target needs TRITON_INTERPRET unset")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    builds = []
    for kernel, _grid, kwargs in _record_calls(spec, batch, num_kv, capacity, num_splits):
        signature, constants, attrs = _signature(kernel, kwargs)
        options = {
            "num_warps": kwargs.get("num_warps", 4),
            "num_stages": kwargs.get("num_stages", 2),
        }
        compiled = triton.compile(
            ASTSource(kernel, signature, constants, attrs),
            target=GPUTarget("cuda", arch, 32),
            options=options,
        )
        regs, spills = _ptxas_usage(compiled.asm["ptx"], arch)
        builds.append(
            KernelBuild(
                name=kernel.__name__,
                arch=arch,
                registers=regs,
                spill_bytes=spills,
                shared_bytes=int(compiled.metadata.shared),
                num_warps=options["num_warps"],
            )
        )
        logger.info("built %s for sm_%d: %s", kernel.__name__, arch, builds[-1])
    return builds
