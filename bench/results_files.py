"""A benchmark's result files: ``{name}.json``, ``{name}.csv`` and ``{name}.png`` in one folder (every bench script).

Imported by the scripts in ``bench/`` (their folder is on the path when they run as scripts).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path


def write_results(out: Path, name: str, result: dict, rows: list[dict], plot: Callable[[Path], None]) -> None:
    """Write ``result`` as JSON, ``rows`` as CSV (the union of their fields; a missing field is empty) and the
    figure ``plot`` draws into the path it is given, under ``out`` (created if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)), restval="")
        writer.writeheader()
        writer.writerows(rows)
    plot(out / f"{name}.png")
