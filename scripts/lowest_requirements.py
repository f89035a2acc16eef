"""Print the runtime's lowest declared versions as pins, one requirement a line.

Reads ``pyproject.toml``: every runtime dependency and the ``[cpu]`` extra, each pinned to
its floor (``numpy>=1.26,<3`` gives ``numpy==1.26``). scripts/test_lowest.sh installs
these into a second venv, so the floors in pyproject.toml are the versions it tests.

Raises:
    SystemExit: a dependency without a ``>=`` floor (the file must declare one for each).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def lowest_pins(pyproject: Path = PYPROJECT, extras: tuple[str, ...] = ("cpu",)) -> list[str]:
    """``name==floor`` for the runtime dependencies and the given extras of ``pyproject``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    pins = []
    for text in requirements:
        requirement = Requirement(text)
        floors = [s.version for s in requirement.specifier if s.operator == ">="]
        if len(floors) != 1:
            raise SystemExit(f"{pyproject}: {text!r} needs exactly one '>=' floor for the lowest-versions test")
        pins.append(f"{requirement.name}=={floors[0]}")
    return pins


if __name__ == "__main__":
    print("\n".join(lowest_pins(extras=tuple(sys.argv[1:]) or ("cpu",))))
