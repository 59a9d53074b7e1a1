#!/usr/bin/env bash
# The lent GPU machines' torch and triton (torch 2.11, triton 3.6; docs/gpu.md), checked here
# on CPU before a device is (issue 55, item 1). CI and .venv run torch 2.13 and triton 3.9.
#   1. every torch name our package, the device benchmarks and the device tests reach exists in
#      torch $TORCH's sources (scripts/torch_api_check.py; the sources come from its macOS wheel,
#      80 MB, not the multi-GB CUDA build: the Python files are the same);
#   2. triton $TRITON's compiler front end takes every kernel variant for an sm_90 target with
#      the argument types inductor gives (tests/test_kernel_step.py, run with that triton first
#      on the path; the torch is still .venv's).
# Downloads are cached in $CACHE (default out/device_image). Exit status 0 when both pass.
#   bash scripts/device_image_check.sh
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TORCH=${TORCH:-2.11.0}
TRITON=${TRITON:-3.6.0}
CACHE=${CACHE:-out/device_image}
mkdir -p "$CACHE"
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
fetch() {  # fetch NAME==VERSION pip-download-args...
  local spec=$1; shift
  ls "$CACHE"/"${spec%%==*}"-"${spec##*==}"-*.whl >/dev/null 2>&1 && return 0
  "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp "$@" -d "$CACHE" "$spec"
}
fetch "torch==$TORCH" --python-version 3.12 --platform macosx_11_0_arm64
fetch "triton==$TRITON" --python-version "$pyver" --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
site="$CACHE/triton-$TRITON-site"
[ -d "$site/triton" ] || "$PY" -m pip install -q --no-deps --target "$site" "$CACHE"/triton-"$TRITON"-*.whl
status=0
echo "== torch $TORCH: the torch names we reach"
"$PY" scripts/torch_api_check.py "$CACHE"/torch-"$TORCH"-*.whl || status=1
echo "== triton $TRITON: the kernels through the compiler's front end (sm_90)"
got=$(PYTHONPATH="$site" "$PY" -c "import triton; print(triton.__version__)")
[ "$got" = "$TRITON" ] || { echo "triton $got imported, not $TRITON"; exit 1; }
PYTHONPATH="$site" "$PY" -m pytest -q -p no:cacheprovider tests/test_kernel_step.py \
  -k the_kernels_compile_with_the_argument_types_inductor_gives_them || status=1
echo "device_image_check: exit $status"
exit $status
