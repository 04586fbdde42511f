#!/usr/bin/env bash
# Builds a copy of this checkout against another torch, in a virtual environment of its own, and runs
# the README's main command (tools/demo.py) and the split, sync and fusion test modules there (fusion
# matches eager's CPU kernels op by op: their rounding is that torch's). The torch
# versions setup.py declares are the ones this script has run (DESIGN.md §8: 2.11 on the GPU
# machines, 2.13 in CI).
#
#   tools/check_torch.sh VERSION            e.g. tools/check_torch.sh 2.11.0
#   tools/check_torch.sh VERSION --sanitize the same tests on an ASan + UBSan build against that torch
#                                           (build/check-torch-VERSION/asan): a memory error that only
#                                           that torch's kernels or boxing expose (core/boxed.h)
#
# Python: 3.12 for torch < 2.13 (PYENV_VERSION=3.12.1 python3.12, as the GPU machines run it), else
# python3; CHECK_TORCH_PYTHON overrides. The environment and the copy live in build/check-torch-VERSION
# (CHECK_TORCH_VENV: an existing environment with that torch instead). Prints a summary line per step;
# exit status 1 if any failed.
set -uo pipefail
VERSION=${1:?usage: tools/check_torch.sh VERSION [--sanitize]}
SANITIZE=${2:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$ROOT/build/check-torch-$VERSION
mkdir -p "$WORK"

case "$VERSION" in
  2.11.*|2.12.*) DEFAULT_PY="env PYENV_VERSION=3.12.1 python3.12" ;;
  *) DEFAULT_PY=python3 ;;
esac
PY=${CHECK_TORCH_PYTHON:-$DEFAULT_PY}
VENV=${CHECK_TORCH_VENV:-$WORK/venv}
if [ ! -x "$VENV/bin/python" ]; then
  $PY -m venv "$VENV" || exit 1
fi
V=$VENV/bin/python
"$V" -m pip install -q --disable-pip-version-check "torch==$VERSION" "transformers==5.18.0" "setuptools>=64" wheel \
  ninja pytest expecttest numpy psutil || exit 1
"$V" -c "import torch; assert torch.__version__.split('+')[0] == '$VERSION', torch.__version__" || exit 1

# The checkout as it is (tracked and untracked files git does not ignore), built in place there.
SRC=$WORK/src
mkdir -p "$SRC"
(cd "$ROOT" && git ls-files -co --exclude-standard | grep -v '^build/' | tar -cf - -T -) | tar -xf - -C "$SRC"

status=0
step() {
  local name=$1
  shift
  local t0=$SECONDS
  if (cd "$SRC" && "$@") >"$WORK/$name.log" 2>&1; then
    echo "torch $VERSION: $name ok ($((SECONDS - t0)) s)"
  else
    echo "torch $VERSION: $name FAILED ($((SECONDS - t0)) s; $WORK/$name.log):"
    tail -n 15 "$WORK/$name.log"
    status=1
  fi
}
if [ "$SANITIZE" = "--sanitize" ]; then
  # As tools/test.sh --sanitize: the package beside the instrumented libraries, sanitizer runtimes
  # preloaded, Python's allocator bypassed, freed device memory guarded.
  ASAN=$WORK/asan
  mkdir -p "$ASAN/pkg"
  rm -rf "$ASAN/pkg/torch_lazymem" && cp -r "$SRC/torch_lazymem" "$ASAN/pkg/" && rm -rf "$ASAN/pkg/torch_lazymem/lib"
  find "$ASAN/pkg/torch_lazymem" -name '*.so' -delete
  step build-asan env LAZYMEM_SANITIZE=address "$V" setup.py -q build_ext --build-lib "$ASAN/pkg" --build-temp "$ASAN/temp"
  SAN_RT="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
  step tests-asan env -C "$ASAN/pkg" ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:allow_user_segv_handler=1:detect_odr_violation=0:suppressions=$ROOT/tools/sanitize/asan.supp" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$ROOT/tools/sanitize/ubsan.supp" \
    LAZYMEM_GUARD_FREED=1 PYTHONMALLOC=malloc LD_PRELOAD="$SAN_RT" PYTHONPATH="$ASAN/pkg:$SRC/test/python" \
    "$V" -m pytest -q -x -p no:cacheprovider --rootdir "$SRC/test/python" -k "not test_rule_fuzzer" \
    $(ls "$SRC"/test/python/test_split_*.py | grep -v -e test_split_models -e test_split_everywhere) \
    "$SRC/test/python/test_sync_points.py" "$SRC/test/python/test_fusion.py"
  [ -f "$WORK/tests-asan.log" ] && grep -E "passed|failed" "$WORK/tests-asan.log" | tail -n 1
  exit $status
fi
step build "$V" setup.py -q build_ext --inplace
step demo env PYTHONPATH=. "$V" tools/demo.py
step tests env PYTHONPATH=. "$V" -m pytest -q -p no:cacheprovider test/python/test_split_*.py test/python/test_sync_points.py \
  test/python/test_fusion.py
[ -f "$WORK/tests.log" ] && grep -E "passed|failed" "$WORK/tests.log" | tail -n 1
exit $status
