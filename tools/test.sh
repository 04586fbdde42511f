#!/usr/bin/env bash
# Runs every test: the layering check of csrc/, the GoogleTest suite of the C++ core (linked
# against the same liblazymem_core.so the Python module loads) and the pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."

python tools/check_includes.py
cmake -S test/cpp -B test/cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build test/cpp/build
./test/cpp/build/lazymem_cpp_tests --gtest_brief=1

python -m pytest -q test/python "$@"
