"""What the install gives: the package to install when a provider or onnxruntime is missing,
and dependency ranges that the lock file and the lowest-versions venv stay inside."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from runtime.backends.onnx import require_provider

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCK = {Requirement(line).name.lower().replace("_", "-"): Requirement(line).specifier
        for line in (ROOT / "requirements/lock.txt").read_text().splitlines() if line and not line.startswith("#")}
_SPEC = importlib.util.spec_from_file_location("lowest_requirements", ROOT / "scripts/lowest_requirements.py")
lowest_requirements = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(lowest_requirements)


def all_requirements() -> list[Requirement]:
    """The runtime's dependencies and every extra's but [gpu] and [trt] (not in the lock: no GPU here)."""
    extras = [name for name in PROJECT["optional-dependencies"] if name not in {"gpu", "trt"}]
    return [Requirement(r) for r in PROJECT["dependencies"] + sum((PROJECT["optional-dependencies"][e]
                                                                    for e in extras), [])]


@pytest.mark.parametrize("provider, package", [("cuda", "mars-edge[gpu]"), ("tensorrt", "mars-edge[gpu]")])
def test_missing_provider_names_the_package_in_one_line(provider, package):
    with pytest.raises(ValueError) as error:
        require_provider(provider)
    message = str(error.value)
    assert "\n" not in message
    assert package in message and "pip uninstall -y onnxruntime," in message, message
    assert "CPUExecutionProvider" in message  # what this build has


def test_cpu_provider_is_in_the_cpu_extra():
    assert require_provider("cpu") == "CPUExecutionProvider"


def test_runtime_without_onnxruntime_says_which_extra_to_install():
    script = 'import sys; sys.modules["onnxruntime"] = None; import runtime.backends.onnx'
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "the runtime needs onnxruntime" in done.stderr and "mars-edge[cpu]" in done.stderr, done.stderr


# The three command-line tools as a user starts them: ``python -m MODULE ARGS`` (runpy) or the
# ``mars-eval`` console script (which imports its module, then calls main).
CLIS = {
    "generate": 'import runpy; sys.argv = ["generate", "bundle", "--prompt", "hi"]; '
                'runpy.run_module("runtime.generate", run_name="__main__")',
    "serve": 'import runpy; sys.argv = ["serve", "bundle"]; runpy.run_module("runtime.serve", run_name="__main__")',
    "mars-eval": 'from runtime.evaluation.cli import main; sys.exit(main(["bundle", "--gsm8k", "test.jsonl"]))',
    "mars-export": 'from mars_export.cli import main; sys.exit(main(["default", "-o", "bundle", "--block", "4"]))',
    "serve_ray": 'import runpy; sys.argv = ["serve_ray", "bundle"]; '
                 'runpy.run_module("runtime.serve_ray", run_name="__main__")',
    "mars-train distill": 'from mars_export.training.cli import main; '
                          'sys.exit(main(["distill", "bundle", "--prompts", "p.jsonl", "--output", "out.jsonl"]))',
}


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_cli_without_onnxruntime_says_which_extra_to_install_in_one_line(cli, tmp_path):
    script = 'import sys; sys.modules["onnxruntime"] = None; ' + CLIS[cli]
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the runtime needs onnxruntime"), done.stderr
    assert "pip install 'mars-edge[cpu]'" in lines[0] and "mars-edge[gpu]" in lines[0]
    assert not list(tmp_path.iterdir())  # nothing written


def test_every_dependency_has_a_floor_and_a_ceiling():
    for requirement in all_requirements() + [Requirement(r) for r in PROJECT["optional-dependencies"]["trt"]]:
        operators = sorted(s.operator for s in requirement.specifier)
        assert operators == ["<", ">="], f"{requirement}: give a '>=' floor and a '<' ceiling (pyproject.toml)"


def test_the_lock_is_inside_the_ranges():
    for requirement in all_requirements():
        locked = LOCK.get(requirement.name.lower().replace("_", "-"))
        assert locked is not None, f"{requirement.name} is missing from requirements/lock.txt"
        (version,) = [s.version for s in locked]
        assert requirement.specifier.contains(version), f"lock has {requirement.name}=={version}, outside {requirement}"


def test_lowest_pins_are_the_floors_of_the_runtime_and_cpu_extra():
    pins = [Requirement(p) for p in lowest_requirements.lowest_pins()]
    wanted = [Requirement(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["cpu"]]
    assert [p.name for p in pins] == [r.name for r in wanted]
    for pin, requirement in zip(pins, wanted):
        (floor,) = [s.version for s in requirement.specifier if s.operator == ">="]
        assert str(pin.specifier) == f"=={floor}"


def test_lowest_pins_refuse_a_dependency_without_floor(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["numpy<3"]\n[project.optional-dependencies]\ncpu = []\n')
    with pytest.raises(SystemExit, match="'numpy<3' needs exactly one '>=' floor"):
        lowest_requirements.lowest_pins(pyproject)
