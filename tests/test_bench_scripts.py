"""Smoke tests of the benchmark scripts: tiny bundles, small arguments, outputs written (never a timing)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_script(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_profile_step_writes_times_and_op_breakdown(tiny_bundle, tmp_path):
    bundle = tiny_bundle("llama", 4)[1]
    copy = shutil.copytree(bundle, tmp_path / "copy")
    stdout = run_script("profile_step.py", str(bundle), str(copy), "--pasts", "6", "0", "--windows", "1", "3",
                        "--steps", "2", "--rounds", "1", "--threads", "1", "--out", str(tmp_path), "--name", "p")
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [(r["past"], r["window"], r["bundle"]) for r in rows] == \
        [(p, w, str(b)) for p in (6, 0) for w in (1, 3) for b in (bundle, copy)]
    for row in rows:
        assert min(row["step_ms"], row["cpu_ms"], row["greedy_ms"], row["ratio_to_first"], row["cpu_ratio_to_first"]) > 0
    assert [r["ratio_to_first"] for r in rows[0::2]] == [1.0] * 4
    for row in rows[:4]:  # the op breakdown is taken at the first past
        assert row["ops"]["MatMul"]["nodes"] > 0 and abs(sum(o["share"] for o in row["ops"].values()) - 1) < 1e-6
    assert all(not row["ops"] for row in rows[4:])
    assert "| op type | nodes | ms/step | share |" in stdout
