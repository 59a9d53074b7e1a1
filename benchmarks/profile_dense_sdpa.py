"""``benchmarks.profile_decode`` with the dense shortcut's SDPA body on CPU (the code before issue
51 moved a CPU decode step's dense shortcut to the fused products), for the A/B in
docs/benchmarks.md ("How the step got here"). Same arguments as ``profile_decode``.

It swaps the one name ``aten_step._dense_store_attention`` reads to decide, so run it with a
``TORCHINDUCTOR_CACHE_DIR`` of its own: torch's caches key on the sources, which this leaves
unchanged, and would otherwise hand back the fused step.

    TORCHINDUCTOR_CACHE_DIR=/tmp/ic_sdpa python -m benchmarks.profile_dense_sdpa --context 8192 --budget 16384 --steps 8 --random-kv
"""

import runpy
import sys

from specontext_compile.runtime import aten_step


def main() -> None:
    aten_step.fused_products = lambda *args, **kwargs: False  # only _dense_store_attention reads this name
    sys.argv = ["benchmarks.profile_decode", *sys.argv[1:]]
    runpy.run_module("benchmarks.profile_decode", run_name="__main__")


if __name__ == "__main__":
    main()
