#!/usr/bin/env bash
# Prepare the GPU machine for miles, offline, in seconds:
#   1. install the carried Python 3.12 wheels from .whl/ (made by scripts/fetch_device_wheels.sh);
#   2. install every workspace package editable, without dependencies (the image has torch 2.11
#      and the rest; no resolver, no index, no build isolation);
#   3. build miles-native with the machine's nvcc (CUDA on, sm_90), editable;
#   4. import everything and print what was built.
#
# Usage on the device (carry ".whl" with the call):
#   bash scripts/device_setup.sh && python3 -m pytest tests/gpu
#
# Environment: PYTHON (default python3), WHEELS (default .whl), MILES_NATIVE_CUDA (default ON;
# AUTO or OFF for a CPU-only build), CUDA_ARCHS (default 90, the H200's sm_90).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
export MILES_NATIVE_CUDA=${MILES_NATIVE_CUDA:-ON}
CUDA_ARCHS=${CUDA_ARCHS:-90}
PIP=("$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check)
start=$SECONDS

say() { echo "device_setup [$((SECONDS - start))s]: $*"; }

say "$("$PYTHON" -c 'import sys; print("python", sys.version.split()[0])'),\
 $("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || echo "no torch")"

# 1. Carried wheels.
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
  say "installing ${#wheels[@]} carried wheels from $WHEELS/"
  "${PIP[@]}" "${wheels[@]}"
else
  say "no wheels in $WHEELS/ (run scripts/fetch_device_wheels.sh here and carry .whl)"
fi
for backend in hatchling scikit_build_core pybind11; do
  if ! "$PYTHON" -c "import $backend" 2>/dev/null; then
    echo "device_setup: build backend '$backend' is missing; carry it in $WHEELS/ (scripts/fetch_device_wheels.sh)" >&2
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
    || { echo "device_setup: miles_native was built without CUDA" >&2; exit 1; }
fi
say "done"
