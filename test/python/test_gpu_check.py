"""tools/gpu_check.py in its CPU smoke mode (LAZYMEM_GPU_CHECK_DEVICE=cpu): every check that does not
need CUDA runs at tiny sizes, eager on the CPU against lazymem on the CPU backing device, where the
bitwise checks hold; the CUDA-only rows are skipped. Tests the tool's structure (workers, table,
json) on a machine without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKS = ["mixing", "first_use", "mlp", "gpt2", "gpt2_split", "bf16", "opinfo", "cap", "tiny", "speed"]
CUDA_ONLY = {"mixing", "cap"}


def test_gpu_check_smoke(tmp_path):
    env = {**os.environ, "LAZYMEM_GPU_CHECK_DEVICE": "cpu", "OUT": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]

    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")][1:]  # the head row left out
    assert len(rows) == len(CHECKS), proc.stdout
    cells = [[c.strip() for c in row.strip("|").split(" | ")] for row in rows]
    assert [c[0].split()[0] for c in cells] == [str(i) for i in range(1, len(CHECKS) + 1)]
    assert (tmp_path / "gpu_check.md").read_text().splitlines()[-len(CHECKS):] == rows

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"device", "torch", "python", "elapsed_s", "checks"} <= report.keys()
    assert list(report["checks"]) == CHECKS
    for name, check in report["checks"].items():
        assert {"title", "result", "figures"} <= check.keys()
        if name in CUDA_ONLY:
            assert check["result"] == "skip" and check["figures"] == {"reason": "no CUDA"}
        else:
            assert check["result"] == "ok", (name, check)
    for check, cell in zip(report["checks"].values(), cells):
        assert cell[0] == check["title"] and cell[1] == check["result"]

    figures = {name: check["figures"] for name, check in report["checks"].items()}
    for name in ("mlp", "gpt2"):  # unsplit lazymem on the CPU backing is bitwise eager
        equal, total = map(int, figures[name]["params equal"].split("/"))
        assert equal == total > 0 and figures[name]["max diff"] == 0.0 and figures[name]["splits"] == 0
    assert figures["gpt2_split"]["splits"] > 0 and figures["gpt2_split"]["chunks"] > 1
    assert figures["gpt2_split"]["budget MiB"] < figures["gpt2_split"]["unsplit peak MiB"]
    equal, total = map(int, figures["opinfo"]["samples equal"].split("/"))
    assert equal == total > 40 and figures["opinfo"]["mismatches"] == {}
    assert figures["tiny"]["values equal"] and figures["tiny"]["lazymem us/op"] > 0
    assert figures["first_use"]["backing"] == "cpu"
    # the speed rows: unsplit, pipelined or not, every step's loss is eager's bitwise
    assert figures["speed"]["losses equal"] and figures["speed"]["times"]["lazy"]
