#!/usr/bin/env bash
# Download the Python 3.12 wheels a GPU node without package-index access needs, into DEST_DIR.
#
#   scripts/fetch_offline_wheels.sh DEST_DIR     # on a machine with the index, then copy DEST_DIR
#
# For a GPU node whose image already holds torch (with CUDA), transformers, peft, safetensors,
# xxhash, httpx, numpy, pyyaml, rich, tqdm, tensorboard, matplotlib, pytest, packaging, pathspec
# and pluggy: what such an image lacks, and miles needs, is listed below. Versions come from
# uv.lock where the workspace locks them (the Python >= 3.12 entry), so the node runs what CI
# resolved; megatron-core is the 0.16 line CI (Python 3.11) tests. Build backends are pinned here:
# they are not in uv.lock. typing-extensions and packaging are included (though such images have
# them) because pydantic and hatchling need recent ones.
#
# Ray's wheel (~79 MB) is written without its Java jars (scripts/strip_ray_wheel.py: ~45 MB,
# Python actors only), so `miles train` runs on such a node; with NO_RAY=1 it is left out and the
# node runs the backends under torchrun. Set PYTHON for the interpreter that reads uv.lock
# (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ne 1 ]; then
  echo "usage: scripts/fetch_offline_wheels.sh DEST_DIR" >&2
  exit 2
fi
DEST=$1
PYTHON=${PYTHON:-python3}

# name -> version ("lock" = take it from uv.lock).
PACKAGES=(
  "megatron-core=0.16.1"
  "scikit-build-core=1.1.2"
  "pybind11=3.1.0"
  "hatchling=1.33.0"
  "trove-classifiers=2026.9.21.13"
  "editables=0.6"
  "tomlkit=0.13.3"
  "zstandard=lock"
  "blake3=lock"
  "fastapi=lock"
  "starlette=lock"
  "pydantic=lock"
  "pydantic-core=lock"
  "annotated-types=lock"
  "typing-inspection=lock"
  "uvicorn=lock"
  "opentelemetry-api=lock"
  "annotated-doc=lock"
  "typing-extensions=lock"
  "packaging=lock"
)
if [ "${NO_RAY:-0}" != 1 ]; then
  # Ray and what it needs beyond such an image (jsonschema's family).
  PACKAGES+=(
    "ray=lock"
    "jsonschema=lock"
    "jsonschema-specifications=lock"
    "referencing=lock"
    "rpds-py=lock"
  )
fi

locked_version() {
  "$PYTHON" - "$1" <<'EOF'
import sys, tomllib
name = sys.argv[1]
entries = [p for p in tomllib.load(open("uv.lock", "rb"))["package"] if p["name"] == name]
if not entries:
    sys.exit(f"fetch_offline_wheels: {name} is not in uv.lock; pin it in PACKAGES")
for p in entries:  # several entries: the one resolved for Python >= 3.12
    if any(">= '3.12'" in m for m in p.get("resolution-markers", [])):
        print(p["version"]); break
else:
    print(entries[0]["version"])
EOF
}

mkdir -p "$DEST"
specs=()
for entry in "${PACKAGES[@]}"; do
  name=${entry%%=*}
  ver=${entry#*=}
  if [ "$ver" = lock ]; then ver=$(locked_version "$name"); fi
  specs+=("$name==$ver")
done

# One version of each package: drop stale wheels of the same names first.
for spec in "${specs[@]}"; do
  stem=$(echo "${spec%%==*}" | tr '-' '_')
  rm -f "$DEST/${stem}"-[0-9]*.whl
done

echo "fetch_offline_wheels: ${specs[*]}"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$DEST" "${specs[@]}"

shopt -s nullglob
for wheel in "$DEST"/ray-[0-9]*.whl; do
  tmp=$(mktemp -d)
  "$PYTHON" scripts/strip_ray_wheel.py "$wheel" "$tmp"
  mv "$tmp/$(basename "$wheel")" "$wheel"
  rmdir "$tmp"
done
shopt -u nullglob

du -sh "$DEST"
ls "$DEST"
