#!/usr/bin/env bash
# Prepare a GPU node for the GPU tests and benchmarks, offline, in seconds:
#   1. install the Python 3.12 wheels in WHEEL_DIR (made by scripts/fetch_offline_wheels.sh), if any;
#   2. install every workspace package editable, without dependencies (the node's image has torch
#      with CUDA and the rest; no resolver, no index, no build isolation);
#   3. build miles-native with the node's nvcc (CUDA on, sm_90 by default), editable;
#   4. import everything and print what was built.
#
#   bash scripts/gpu_node_setup.sh [WHEEL_DIR] && python3 -m pytest tests/gpu
#
# On a GPU node that reaches the package index, `uv sync` (CUDA torch from the lock) followed by
# the native build of BUILD_NOTES.md does the same; this script is for images without an index.
# Environment: PYTHON (default python3), MILES_NATIVE_CUDA (default ON; AUTO or OFF for a CPU-only
# build), CUDA_ARCHS (default 90: Hopper).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELS=${1:-}
export MILES_NATIVE_CUDA=${MILES_NATIVE_CUDA:-ON}
CUDA_ARCHS=${CUDA_ARCHS:-90}
PIP=("$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check)
start=$SECONDS

say() { echo "gpu_node_setup [$((SECONDS - start))s]: $*"; }

say "$("$PYTHON" -c 'import sys; print("python", sys.version.split()[0])'),\
 $("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || echo "no torch")"

# 1. The offline wheels.
wheels=()
if [ -n "$WHEELS" ]; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  [ ${#wheels[@]} -gt 0 ] || say "no wheels in $WHEELS/"
fi
if [ ${#wheels[@]} -gt 0 ]; then
  say "installing ${#wheels[@]} wheels from $WHEELS/"
  "${PIP[@]}" "${wheels[@]}"
fi
for backend in hatchling scikit_build_core pybind11; do
  if ! "$PYTHON" -c "import $backend" 2>/dev/null; then
    echo "gpu_node_setup: build backend '$backend' is missing; put its wheel in WHEEL_DIR (scripts/fetch_offline_wheels.sh)" >&2
    exit 1
  fi
done

# 2. The Python packages, editable, in one pip call.
members=()
for dir in packages/*/; do members+=(-e "${dir%/}"); done
say "installing ${members[*]}"
"${PIP[@]}" --no-build-isolation "${members[@]}"

# 3. The native extension, built here with the local toolkit.
if [ "$MILES_NATIVE_CUDA" != OFF ] && ! command -v nvcc >/dev/null 2>&1; then
  for cuda in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$cuda/nvcc" ]; then export PATH="$cuda:$PATH"; break; fi
  done
fi
if command -v nvcc >/dev/null 2>&1; then say "$(nvcc --version | tail -1)"; fi
say "building native (MILES_NATIVE_CUDA=$MILES_NATIVE_CUDA, sm_$CUDA_ARCHS)"
CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS" \
  "${PIP[@]}" --no-build-isolation -e native

# 4. Check.
"$PYTHON" - <<'EOF'
import importlib

for name in ("miles_core", "miles_offload", "miles_sync", "miles_fsdp", "miles_megatron",
             "miles_launch", "miles_native"):
    module = importlib.import_module(name)
    print(f"  {name} {module.__version__}")
import miles_native
from miles_core import backends

print(f"  {miles_native.build_info()}")
print(f"  backends registered: {', '.join(backends.available()) or 'none'}")
EOF
if [ "$MILES_NATIVE_CUDA" = ON ]; then
  "$PYTHON" -c "import miles_native, sys; sys.exit(0 if miles_native.built_with_cuda() else 1)" \
    || { echo "gpu_node_setup: miles_native was built without CUDA" >&2; exit 1; }
fi
say "done"
