"""Helpers shared by the test modules: exporting through the CLI, and real prompts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def export(model: str, out: Path, block: int, window: int, *extra: str) -> Path:
    """Run ``mars-export`` in-process and return the bundle directory."""
    from mars_export.cli import main
    assert main([model, "-o", str(out), "--block", str(block), "--window", str(window), *extra]) == 0
    return out


def real_prompts(num_each: int) -> list[tuple[str, str]]:
    """(kind, text) of the first ``num_each`` GSM8K test questions and HumanEval prompts."""
    gsm8k = [json.loads(line)["question"] for line in (SHARED_DATA / "gsm8k/test.jsonl").open()][:num_each]
    with gzip.open(SHARED_DATA / "humaneval/HumanEval.jsonl.gz", "rt") as f:
        humaneval = [json.loads(line)["prompt"] for line in f][:num_each]
    return [("gsm8k", q) for q in gsm8k] + [("humaneval", p) for p in humaneval]
