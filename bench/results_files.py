"""A benchmark's result files: ``{name}.json``, ``{name}.csv`` and ``{name}.png`` in one folder (every bench script).

Imported by the scripts in ``bench/`` (their folder is on the path when they run as scripts). A script adds the
options that place them with :func:`add_results_options` (``--name`` parsed by
:func:`runtime.command_line.results_name`, the one rule on the files' stem), refuses to replace an earlier run's with
:func:`check_results` before anything loads, and writes them with :func:`write_results`.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable
from pathlib import Path

from runtime.command_line import check_results_folder, path_value, results_name

SUFFIXES = (".json", ".csv", ".png")


def add_results_options(p: argparse.ArgumentParser, name: str) -> None:
    """Add ``--out`` (the folder, default ``bench/results``), ``--name`` (the files' stem, default ``name``,
    checked by :func:`runtime.command_line.results_name`) and ``--force`` (replace an earlier run's files) to the
    script's parser ``p``."""
    p.add_argument("--out", type=path_value, default=Path(__file__).resolve().parent / "results",
                   help="folder of the result files (default bench/results)")
    p.add_argument("--name", type=results_name, default=name,
                   help=f"stem of the result files, no '/' (default {name})")
    p.add_argument("--force", action="store_true",
                   help="replace the result files of an earlier run of this --name in --out (default: refuse)")


def check_results(args: argparse.Namespace) -> None:
    """Refuse, before anything loads, an ``args.out`` the result files ``args.name.*`` cannot be written to, or
    where an earlier run's would be replaced without ``args.force``
    (:func:`runtime.command_line.check_results_folder`, mars-eval's rule).

    Raises:
        UsageError: naming the path and the fix (``--force``, or another ``--out``).
    """
    check_results_folder(args.out, [f"{args.name}{suffix}" for suffix in SUFFIXES], args.force)


def write_results(out: Path, name: str, result: dict, rows: list[dict], plot: Callable[[Path], None]) -> None:
    """Write ``result`` as JSON, ``rows`` as CSV (the union of their fields; a missing field is empty) and the
    figure ``plot`` draws into the path it is given, under ``out`` (created if missing)."""
    json_path, csv_path, png_path = (out / f"{name}{suffix}" for suffix in SUFFIXES)
    out.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)), restval="")
        writer.writeheader()
        writer.writerows(rows)
    plot(png_path)
