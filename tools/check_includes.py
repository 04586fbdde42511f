"""Checks the layering of csrc/ (DESIGN.md §4): each stage includes only the stages below it.

    core <- ir <- device <- record <- sync      core <- ops <- record, plan
    ir, ops <- plan <- execute <- sync          python: anything

Dependencies point one way: nothing below sync includes sync, record never includes execute (an op
that needs real data says so and sync runs it), execute never consults op rules (the Plan carries
every decision), plan never touches a device. No file outside python/ includes Python or pybind11,
and none but cuda/ (the CUDA backend's own library: graph capture, the allocator's trace) includes
CUDA headers (everything else reaches CUDA through the dispatcher). Exit status 1 on any
violation; run by tools/test.sh.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "csrc"

ALLOWED = {
    "core": {"core"},
    "ir": {"core", "ir"},
    "ops": {"core", "ops"},
    "device": {"core", "ir", "device"},
    "record": {"core", "ir", "ops", "device", "record"},
    "plan": {"core", "ir", "ops", "plan"},
    "execute": {"core", "ir", "device", "plan", "execute"},
    "sync": {"core", "ir", "ops", "device", "record", "plan", "execute", "sync"},
    "distributed": {"core", "ir", "device", "sync", "distributed"},
    # liblazymem_cuda.so (core/cuda_backend.h): built only against a torch with CUDA.
    "cuda": {"core", "cuda"},
}
FORBIDDEN_SYSTEM = [
    (re.compile(r"^(Python\.h|frameobject\.h|pybind11/|torch/extension\.h|torch/python\.h|torch/csrc/(Exceptions|Generator|python|utils/))"), "Python bindings"),
    (re.compile(r"^(c10/cuda/|ATen/cuda/|cuda\.h|cuda_runtime)"), "CUDA headers"),
]
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def violations(root: pathlib.Path = ROOT) -> list[str]:
    out = []
    layers = {p.name for p in root.iterdir() if p.is_dir()}
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cpp"):
            continue
        layer = path.relative_to(root).parts[0]
        if layer == "python":
            continue
        if layer not in ALLOWED:
            out.append(f"{path.relative_to(root)}: folder '{layer}' has no place in the layering (tools/check_includes.py)")
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            kind, target = m.groups()
            where = f"{path.relative_to(root)}:{lineno}"
            if kind == '"':
                dep = target.split("/", 1)[0]
                if dep in layers and dep not in ALLOWED[layer]:
                    out.append(f"{where}: {layer}/ includes {target} ({layer} may include {sorted(ALLOWED[layer])})")
            elif layer != "cuda":  # the one place CUDA headers belong (DESIGN.md §8)
                for pattern, what in FORBIDDEN_SYSTEM:
                    if pattern.match(target):
                        out.append(f"{where}: {layer}/ includes <{target}> ({what} are not allowed outside python/)")
    return out


def main() -> int:
    bad = violations()
    for v in bad:
        print(v)
    if bad:
        print(f"{len(bad)} include(s) break the layering of DESIGN.md §4")
        return 1
    print("layering ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
