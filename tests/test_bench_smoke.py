"""Smoke runs of the engine benchmarks on a tiny bundle: every mode of ours runs, the outputs are
written, and the lossless modes (verify with each draft source) reproduce our AR ids. No timing."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERIFY_VARIANTS = ["verify", "verify + lookup", "verify + both"]


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_engine_modes_smoke(tiny_bundle, tmp_path):
    _, bundle = tiny_bundle("llama", 4)
    # one prompt: the tiny model's 512-token context holds a GSM8K question, not a HumanEval prompt, in bytes
    run("bench/engine_modes.py", str(bundle), "--batch-sizes", "1", "2", "--schemes", "continuous", "--taus", "0.5",
        "--num-prompts", "1", "--max-new-tokens", "8", "--threads", "1", "--out", str(tmp_path), "--name", "smoke")
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert len(list(csv.DictReader((tmp_path / "smoke.csv").open()))) == len(rows) == 2 * 5
    verify = [r for r in rows if r["mode"] == "verify"]
    assert sorted({r["draft"] for r in verify}) == ["both", "lookup", "masks"]
    assert all(r["identical_to_ar"] == 1.0 for r in verify)


def test_peers_ours_smoke(tiny_bundle, tmp_path):
    """``prompts``, ``run --engine ours`` and ``report`` of bench/peers.py (the steps of
    scripts/bench_peers.sh with ENGINES=ours), on one prompt (the tiny model's context holds
    a GSM8K question, not a HumanEval prompt, in bytes)."""
    _, bundle = tiny_bundle("llama", 4)
    work, out = tmp_path / "work", tmp_path / "out"
    run("bench/peers.py", "prompts", "--work", str(work), "--bundle", str(bundle), "--num-prompts", "1",
        "--max-new-tokens", "8", "--batch-sizes", "1", "2", "--threads", "1", "--taus", "0.5")
    run("bench/peers.py", "run", "--engine", "ours", "--work", str(work), "--model", str(bundle))
    table = run("bench/peers.py", "report", "--work", str(work), "--out", str(out))
    rows = json.loads((out / "peers.json").read_text())["rows"]
    assert (out / "peers.csv").exists() and (out / "peers.png").stat().st_size > 0
    variants = [r["variant"] for r in rows if r["batch_size"] == 1]
    assert variants == ["ar", "threshold tau=0.5", *VERIFY_VARIANTS]
    assert all(r["status"] == "ok" for r in rows)
    assert all(r["identical_to_ours_ar"] == 1 for r in rows if r["variant"] in ["ar", *VERIFY_VARIANTS])
    assert "| ours | verify + lookup | 2 |" in table
