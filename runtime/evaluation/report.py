"""Write the results: a JSON file (settings, per-prompt records, summary), a CSV of the
summary, and a readable table for the terminal."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from runtime.evaluation.summary import FIELDS, draft_label

RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.csv"

_COLUMNS = (  # (header, field, format); the draft column shows draft_label
    ("bundle", "bundle", "{}"), ("B", "block_size", "{}"), ("tau", "tau", "{:g}"), ("draft", "draft", "{}"), ("TPF", "tpf", "{:.2f}"),
    ("tok/s", "tokens_per_second", "{:.1f}"), ("x AR", "speedup_vs_ar", "{:.2f}"),
    ("exact", "agreement_exact", "{:.2f}"), ("prefix", "agreement_prefix", "{:.2f}"),
    ("gsm8k", "gsm8k_accuracy", "{:.3f}"), ("pass@1", "humaneval_pass_at_1", "{:.3f}"),
)


def write_json(out_dir: Path, settings: dict, records: list[dict], summary: list[dict]) -> Path:
    """``results.json``: {"settings": ..., "summary": [rows], "records": [records]}."""
    path = out_dir / RESULTS_FILE
    path.write_text(json.dumps({"settings": settings, "summary": summary, "records": records}, indent=1) + "\n")
    return path


def write_csv(out_dir: Path, summary: list[dict]) -> Path:
    """``summary.csv``: one line per summary row, columns :data:`~runtime.evaluation.summary.FIELDS`;
    empty cells where a metric does not apply."""
    path = out_dir / SUMMARY_FILE
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in summary)
    return path


def format_table(summary: list[dict]) -> str:
    """The summary as an aligned text table ("-" where a metric does not apply; the draft source
    with `` adaptive`` after it for adaptive masks)."""
    cells = [[header for header, _, _ in _COLUMNS]]
    for row in ({**row, "draft": draft_label(row)} for row in summary):
        cells.append([("-" if row[field] is None else fmt.format(row[field])) for _, field, fmt in _COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])
