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
