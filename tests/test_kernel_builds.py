"""Our C++ CPU kernels build wherever a C++ compiler is on the PATH: their tests skip only
where none is (a failed build must fail here, not skip every kernel test)."""

from __future__ import annotations

import os
import shutil

import pytest
from specontext_compile.runtime import cpu_kernels, cpu_refine, cpu_selection


@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler on the PATH")
@pytest.mark.parametrize("library", [cpu_kernels._library, cpu_refine._library, cpu_selection._library],
                         ids=["decode", "refine", "selection"])
def test_every_kernel_builds_where_a_compiler_is(library):
    library.__wrapped__()  # a KernelBuildError (with the compiler's message) fails this test


@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler on the PATH")
def test_a_header_from_an_include_folder_is_found_and_keys_the_build(tmp_path, monkeypatch):
    """Another package's kernel (the vLLM plugin's) includes our shared header through
    ``includes``: the build finds it, and a changed header builds a new library (its bytes are
    part of the key), never a stale one."""
    import ctypes

    monkeypatch.setenv("SPECONTEXT_KERNEL_CACHE", str(tmp_path / "cache"))
    shared, own = tmp_path / "shared", tmp_path / "own"
    shared.mkdir()
    own.mkdir()
    (shared / "answer.h").write_text("inline int answer() { return 41; }\n")
    source = own / "uses_answer.cpp"
    source.write_text('#include "answer.h"\nextern "C" int value() { return answer(); }\n')
    first = cpu_kernels.build_library(source, includes=(shared,))
    first.value.restype = ctypes.c_int
    assert first.value() == 41
    (shared / "answer.h").write_text("inline int answer() { return 42; }\n")
    second = cpu_kernels.build_library(source, includes=(shared,))
    second.value.restype = ctypes.c_int
    assert second.value() == 42
    assert len(list((tmp_path / "cache").glob("uses_answer_*.so"))) == 2
    with pytest.raises(cpu_kernels.KernelBuildError, match="answer.h"):
        cpu_kernels.build_library(source)  # without the folder the header is not found
