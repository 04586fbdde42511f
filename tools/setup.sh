#!/usr/bin/env bash
# Installs what torch_lazymem needs on a fresh Debian machine (apt: compilers, CMake, GoogleTest;
# pip: the pinned torch CPU build and test tools) and builds the package in place. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  if ! dpkg -s g++ cmake ninja-build libgtest-dev >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ cmake ninja-build libgtest-dev >/dev/null
  fi
fi

python -m pip install -q --disable-pip-version-check \
  "torch==2.13.0" "transformers==5.18.0" "accelerate==1.15.0" "lightning==2.6.6" "setuptools>=64" wheel ninja pytest "pytest-xdist==3.8.0" \
  expecttest numpy psutil
python -m pip install -q --disable-pip-version-check --no-build-isolation -e .
