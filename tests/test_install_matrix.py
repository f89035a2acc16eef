"""The install matrix: the runtime and its extras resolve to wheels on every deploy target.

A resolver runs for each target Python and platform, with no hardware and no install
(``uv pip compile --only-binary :all: --python-version X --python-platform P``), on the
requirements pyproject.toml declares, as ``pip install 'mars-edge[cpu,export]'`` would
resolve them there; its PEP 751 lock lists the one wheel picked for each package. A
dependency without a wheel for a target fails, naming it. Needs PyPI.

uv, not ``pip install --dry-run --report``: without PEP 658 metadata on the index (the
case on this project's machines) pip downloads every candidate wheel whole to read its
metadata, 3.2 GB for torch's CUDA stack per target; uv reads METADATA with range requests
(about 5 MB). The resolves run in parallel, about a minute in all on 2 cores, cache cold.

Targets: JetPack 6 (Ubuntu 22.04, CPython 3.10, aarch64), ARM64 servers and Raspberry Pi
5 (CPython 3.12, aarch64), and x86-64 with CPython 3.10, 3.11 and 3.12, all at
manylinux_2_28 (RHEL 8, Debian 10, Ubuntu 20.04 and newer). Every target gets the runtime
with [cpu] and [export] (the export side resolves on aarch64 too, though exports are made
on a workstation); the x86-64 targets also get [gpu]: onnxruntime-gpu has no aarch64
wheels on PyPI, Jetson takes NVIDIA's (samples/jetson/README.md). [serve-ray] resolves for
an x86-64 and an ARM64 server (cp311-x86_64, cp312-aarch64). [trt] is not here:
tensorrt-cu12 is a source package that fetches its libraries when built.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TARGETS = {"cp310-aarch64": ("3.10", "aarch64"), "cp312-aarch64": ("3.12", "aarch64"),
           "cp310-x86_64": ("3.10", "x86_64"), "cp311-x86_64": ("3.11", "x86_64"), "cp312-x86_64": ("3.12", "x86_64")}
MANYLINUX = "manylinux_2_28"
JOBS = [(target, ("cpu", "export")) for target in TARGETS] + \
       [(target, ("gpu",)) for target, (_, arch) in TARGETS.items() if arch == "x86_64"] + \
       [(target, ("cpu", "serve-ray")) for target in ("cp311-x86_64", "cp312-aarch64")]
WORKERS = 4  # the resolves wait on the network most of the time


def requirements(extras: tuple[str, ...]) -> list[str]:
    """The runtime's dependencies and those of ``extras``, as pyproject.toml declares them."""
    return PROJECT["dependencies"] + [r for extra in extras for r in PROJECT["optional-dependencies"][extra]]


def resolve(python: str, arch: str, reqs: list[str], workdir: Path) -> tuple[dict | None, str]:
    """Resolve ``reqs`` to wheels for CPython ``python`` on ``arch`` Linux (manylinux_2_28).

    Returns:
        ({package name: wheel file name}, or None when it failed; the resolver's stderr).
    """
    (workdir / "requirements.in").write_text("\n".join(reqs) + "\n")
    lock = workdir / "pylock.toml"
    command = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--only-binary", ":all:",
               "--python-version", python, "--python-platform", f"{arch}-{MANYLINUX}",
               str(workdir / "requirements.in"), "-o", str(lock)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        return None, done.stderr
    packages = tomllib.loads(lock.read_text())["packages"]
    return {p["name"]: p["wheels"][0]["url"].rsplit("/", 1)[-1] for p in packages}, done.stderr


def failure(stderr: str) -> str:
    """What has no wheel, e.g. ``no wheel for numpy==2.4.6``, or the resolver's message."""
    missing = re.findall(r"(\S+) has no (?:usable )?wheels", stderr)
    return "no wheel for " + ", ".join(dict.fromkeys(missing)) if missing else stderr.strip()[-2000:]


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict:
    """(target, extras) -> (wheels or None, stderr) for every job, resolved in parallel."""
    def run(job):
        target, extras = job
        python, arch = TARGETS[target]
        return resolve(python, arch, requirements(extras), tmp_path_factory.mktemp(f"{target}-{'-'.join(extras)}"))

    tmp_path_factory.getbasetemp()  # made once here: made lazily by the first mktemp, the threads would race to make it
    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(zip(JOBS, pool.map(run, JOBS)))


@pytest.mark.parametrize("target, extras", JOBS, ids=[f"{t}[{','.join(e)}]" for t, e in JOBS])
def test_resolves_to_wheels(resolved, target, extras):
    wheels, stderr = resolved[target, extras]
    assert wheels is not None, f"{target} mars-edge[{','.join(extras)}]: {failure(stderr)}"
    for requirement in requirements(extras):
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group().lower().replace("_", "-")
        assert name in wheels, f"{target}: {name} is missing from the resolve"
    python, arch = TARGETS[target]
    onnxruntime = wheels["onnxruntime-gpu" if "gpu" in extras else "onnxruntime"]
    assert f"-cp{python.replace('.', '')}-" in onnxruntime and arch in onnxruntime, onnxruntime


def test_a_pin_without_wheel_fails_naming_it(tmp_path):
    """The check can fail: numpy 2.4.6 (the lock's) has no CPython 3.10 wheel."""
    wheels, stderr = resolve("3.10", "aarch64", ["numpy==2.4.6"], tmp_path)
    assert wheels is None and failure(stderr) == "no wheel for numpy==2.4.6", stderr
