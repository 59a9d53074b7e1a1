#!/usr/bin/env bash
# The Python wheels a lent GPU machine lacks (its image: Python 3.12, torch 2.11, transformers
# 5.17): transformers 5.25 and what it needs beyond that image, downloaded here into .whl/
# (ignored by git; scripts/gpu_check.sh installs them there when the folder travels).
#   bash scripts/gpu_wheels.sh            # then carry .whl with the device call
set -eu
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PY=${PY:-.venv/bin/python}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore hf_xet==1.8.0 \
  kernels==0.19.1 tomlkit==0.15.3 regex==2026.11.19 click==8.5.1 anyio==4.16.0
ls .whl
