"""The layering of csrc/ (DESIGN.md §4) holds, and the checker CI runs catches each kind of break."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import check_includes  # noqa: E402


def test_csrc_layering_holds():
    assert check_includes.violations() == []


def test_checker_catches_upward_includes_python_and_cuda(tmp_path):
    for layer in check_includes.ALLOWED:
        (tmp_path / layer).mkdir()
    (tmp_path / "execute" / "rules.cpp").write_text('#include "ops/placement.h"\n')      # execute reads op rules
    (tmp_path / "record" / "x.h").write_text('#include "sync/sync.h"\n#include "ir/node.h"\n')  # record reaches sync
    (tmp_path / "plan" / "p.cpp").write_text("#include <c10/cuda/CUDAStream.h>\n")    # CUDA outside the dispatcher
    (tmp_path / "device" / "d.cpp").write_text("#include <pybind11/pybind11.h>\n")   # Python outside python/
    bad = check_includes.violations(tmp_path)
    assert len(bad) == 4, bad
    assert any("execute/ includes ops/placement.h" in v for v in bad)
    assert any("record/ includes sync/sync.h" in v for v in bad)
    assert any("CUDA headers" in v for v in bad)
    assert any("Python bindings" in v for v in bad)
