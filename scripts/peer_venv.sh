# Sourced by the scripts that make a peer's venv (openvino_venv.sh, kvpress_venv.sh,
# vllm_venv.sh): `peer_venv DIR` creates DIR as a venv if missing, defines `pip` (an array:
# "${pip[@]}" PACKAGES installs quietly into DIR) and `quiet` (drops pip's noise about the
# machine's local indexes), and installs the CPU build of torch 2.13.0 first (a local wheel or
# index if pip has one, else PyTorch's CPU index). Each script then installs with a constraint
# file holding "$TORCH", which keeps every later install from replacing it with a CUDA build.
TORCH="torch==2.13.0+cpu"

quiet() { "$@" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" -e "Running pip as the 'root' user" >&2); }

peer_venv() {
  local venv=$1 py=${PYTHON:-python3.11}
  command -v "$py" >/dev/null 2>&1 || py=python3
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile)
  if ! "$venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__ == '2.13.0+cpu' else 1)" 2>/dev/null; then
    quiet "${pip[@]}" "$TORCH" \
      || quiet "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu "$TORCH"
  fi
}
