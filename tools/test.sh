#!/usr/bin/env bash
# Runs every test: the layering check of csrc/, the GoogleTest suite of the C++ core (linked
# against the same liblazymem_core.so the Python module loads) and the pytest suite.
#
#   tools/test.sh [pytest args]   the normal build (the README's test command)
#   tools/test.sh --sanitize      ASan + UBSan: builds the extension and the C++ tests instrumented
#                                 into build/asan, then runs the C++ suite and the split, sync, memory,
#                                 two-memory, fusion, pipeline and thread pytest modules with the sanitizer runtimes preloaded
#                                 and freed device memory guarded (LAZYMEM_GUARD_FREED=1: a read of it
#                                 faults), then the memory modules again unguarded, with the device's
#                                 block pool on. The per-op rule tables, the model zoo and the everywhere
#                                 matrix (test_split_{rules,models,everywhere}: half the split time,
#                                 four times that under ASan) run in the normal suite only, to keep
#                                 CI under 30 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

if [ "${1:-}" = "--sanitize" ]; then
  shift
  ASAN_DIR=$ROOT/build/asan
  mkdir -p "$ASAN_DIR/pkg"
  # The Python package beside the instrumented libraries (the normal build stays where it is).
  python - "$ASAN_DIR/pkg/torch_lazymem" <<'PY'
import shutil, sys
shutil.copytree("torch_lazymem", sys.argv[1], dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("*.so", "__pycache__", "lib"))
PY
  LAZYMEM_SANITIZE=address python setup.py -q build_ext --build-lib "$ASAN_DIR/pkg" --build-temp "$ASAN_DIR/temp" >/dev/null
  cmake -S test/cpp -B test/cpp/build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLAZYMEM_SANITIZE=ON \
    -DLAZYMEM_CORE_DIR="$ASAN_DIR/pkg/torch_lazymem/lib" >/dev/null
  cmake --build test/cpp/build-asan
  SAN_RT="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
  # Leaks: off (Python and torch keep allocations until exit by design). Python's own allocator is
  # bypassed so ASan sees every block. torch's libraries are not instrumented; the suppressions file
  # lists what they trip.
  export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:allow_user_segv_handler=1:detect_odr_violation=0:suppressions=$ROOT/tools/sanitize/asan.supp"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$ROOT/tools/sanitize/ubsan.supp"
  export LAZYMEM_GUARD_FREED=1
  LD_PRELOAD="$SAN_RT" ./test/cpp/build-asan/lazymem_cpp_tests --gtest_brief=1
  # From build/asan, so that `import torch_lazymem` finds the instrumented package, not the repo's.
  cd "$ASAN_DIR/pkg"
  PYTHONMALLOC=malloc LD_PRELOAD="$SAN_RT" PYTHONPATH="$ASAN_DIR/pkg:$ROOT/test/python" \
    python -m pytest -q -n 2 --dist loadgroup -p no:cacheprovider --rootdir "$ROOT/test/python" -x \
    $(ls "$ROOT"/test/python/test_split_*.py "$ROOT"/test/python/test_sync_points.py "$ROOT"/test/python/test_two_memories.py \
      "$ROOT"/test/python/test_memory.py "$ROOT"/test/python/test_fusion.py "$ROOT"/test/python/test_pipeline.py \
      "$ROOT"/test/python/test_threads.py | grep -v -e test_split_rules -e test_split_models -e test_split_everywhere) "$@"
  # The guard keeps freed device blocks out of reuse, so the simulated device's block pool (which
  # reuses them, as CUDA's caching allocator does) is off above: the memory modules again with it on.
  LAZYMEM_GUARD_FREED=0 PYTHONMALLOC=malloc LD_PRELOAD="$SAN_RT" PYTHONPATH="$ASAN_DIR/pkg:$ROOT/test/python" \
    python -m pytest -q -n 2 --dist loadgroup -p no:cacheprovider --rootdir "$ROOT/test/python" -x \
    "$ROOT"/test/python/test_memory.py "$ROOT"/test/python/test_two_memories.py "$@"
  exit 0
fi

python tools/check_includes.py
cmake -S test/cpp -B test/cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build test/cpp/build
./test/cpp/build/lazymem_cpp_tests --gtest_brief=1

# Two workers (pytest-xdist): the suite is mostly single-threaded Python, and CI has two cores.
# loadgroup: tests marked with one xdist_group run on one worker (a costly module fixture runs once).
python -m pytest -q -n 2 --dist loadgroup test/python "$@"
