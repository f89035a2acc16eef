"""Helpers shared by the test modules: exporting through the CLI, old-style bundles, and real prompts."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# The interpreter of the torch-free runtime tests (marker ``runtime_python``): this venv's,
# or the lowest-declared-versions venv that scripts/test_lowest.sh makes.
RUNTIME_PYTHON = os.path.abspath(os.environ.get("MARS_RUNTIME_PYTHON") or sys.executable)  # not resolved: a venv


def export(model: str, out: Path, block: int, window: int, *extra: str) -> Path:
    """Run ``mars-export`` in-process and return the bundle directory."""
    from mars_export.cli import main
    assert main([model, "-o", str(out), "--block", str(block), "--window", str(window), *extra]) == 0
    return out


def fix_window(bundle: Path, window: int) -> Path:
    """Make ``bundle``'s graph declare a fixed window axis, as exports before 2026-11-30 did."""
    import onnx
    path = bundle / "model.onnx"
    model = onnx.load(path)
    for graph_input in model.graph.input[:3]:  # input_ids, position_ids [B, W]; attention_mask [B, 1, W, K]
        dims = graph_input.type.tensor_type.shape.dim
        dims[2 if graph_input.name == "attention_mask" else 1].dim_value = window
    onnx.save(model, path)
    return bundle


def real_prompts(num_each: int) -> list[tuple[str, str]]:
    """(kind, text) of the first ``num_each`` GSM8K test questions and HumanEval prompts."""
    gsm8k = [json.loads(line)["question"] for line in (SHARED_DATA / "gsm8k/test.jsonl").open()][:num_each]
    with gzip.open(SHARED_DATA / "humaneval/HumanEval.jsonl.gz", "rt") as f:
        humaneval = [json.loads(line)["prompt"] for line in f][:num_each]
    return [("gsm8k", q) for q in gsm8k] + [("humaneval", p) for p in humaneval]


def load_script(path: Path):
    """Import a script (``bench/*.py``, ``scripts/*.py``) as a module, for its smoke test."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module
