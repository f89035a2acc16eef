"""A checkout with no shared data folder beside it (a CI clone in a temporary folder): the
test run collects without an error and the tests that read the folder are skipped, naming it
and MARS_SHARED_DATA."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support import ROOT, SHARED_DATA_ENV

TIMEOUT_S = 600  # far above a healthy collection (seconds); never a timing


def copy_checkout(dest: Path) -> Path:
    """The tracked files of this checkout (working-tree versions) copied to ``dest``."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def pytest_in(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != SHARED_DATA_ENV}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_checkout_without_shared_data_collects_and_skips_naming_the_folder(tmp_path):
    checkout = copy_checkout(tmp_path / "clone")
    assert not (tmp_path / "shared").exists()
    collected = pytest_in(checkout, "--collect-only", "-q")
    summary = collected.stdout.strip().splitlines()[-1]  # "N/M tests collected (K deselected) in S s"
    assert collected.returncode == 0 and "collected" in summary and "error" not in summary, collected.stdout[-3000:]
    ran = pytest_in(checkout, "-q", "-rs", "tests/training/test_training_data.py", "-k", "shared")
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert f"the shared data folder {tmp_path / 'shared' / 'data'} is not here: set {SHARED_DATA_ENV}" in ran.stdout
    assert "3 skipped" in ran.stdout
