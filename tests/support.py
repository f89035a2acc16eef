"""Helpers shared by the test modules: exporting through the CLI, old-style bundles, and real prompts."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The project's shared data folder (GSM8K, HumanEval, training and chat sets): $MARS_SHARED_DATA,
# else ../shared/data beside the checkout. A clone elsewhere has none: the tests that read it
# skip (the ``shared_data`` fixture) and the bench scripts stop with shared_data_missing()'s reason.
SHARED_DATA_ENV = "MARS_SHARED_DATA"
SHARED_DATA = Path(os.environ.get(SHARED_DATA_ENV) or ROOT.parent / "shared" / "data").expanduser().absolute()
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


def shared_data_missing() -> str | None:
    """Why the shared data folder cannot be read (naming the folder and the variable to set), or None."""
    if SHARED_DATA.is_dir():
        return None
    return f"the shared data folder {SHARED_DATA} is not here: set {SHARED_DATA_ENV} to the folder holding gsm8k/, " \
           "humaneval/, ... (default: ../shared/data beside the checkout)"


def shared_data_file(relative: str) -> Path:
    """``SHARED_DATA / relative``; FileNotFoundError with shared_data_missing()'s reason if the folder is missing."""
    missing = shared_data_missing()
    if missing:
        raise FileNotFoundError(missing)
    return SHARED_DATA / relative


def real_prompts(num_each: int) -> list[tuple[str, str]]:
    """(kind, text) of the first ``num_each`` GSM8K test questions and HumanEval prompts.

    Raises FileNotFoundError (naming the folder and MARS_SHARED_DATA) without the shared data."""
    gsm8k = [json.loads(line)["question"] for line in shared_data_file("gsm8k/test.jsonl").open()][:num_each]
    with gzip.open(shared_data_file("humaneval/HumanEval.jsonl.gz"), "rt") as f:
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


def window_logits(session, rows: list[list[int]], cache: list, lengths: list[int]):
    """logits [n, W, V] (numpy) of one step-graph forward of the rows' tokens at positions lengths[b].. over
    the runtime's cache layout (per past input one buffer [n, Hkv, S, D], position p at index p, stale values
    after a row's length, hidden by the mask), bound as the runtime binds it: each present is its past's
    buffer, so the new KV entries are written into ``cache`` at their positions."""
    import numpy as np
    import onnxruntime as ort

    from runtime.backends.kv_binding import KVBinding
    from runtime.decode.batch import window_mask

    window, capacity = len(rows[0]), cache[0].shape[2]
    lengths = np.array(lengths, np.int64)
    positions = lengths[:, None] + np.arange(window)[None]  # [n, W]
    vocab = session.get_outputs()[0].shape[2]
    return KVBinding(session, ort).run_step(np.array(rows, np.int64), positions, window_mask(lengths, capacity, window),
                                            list(zip(cache[0::2], cache[1::2])), vocab)


def declare_old_kv_outputs(bundle: Path) -> None:
    """Declare the step graph's presents as older exports did: [B, H, W, D], the window's new entries only."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"))
    for value in model.graph.output:
        if value.name.startswith("present."):
            value.type.tensor_type.shape.dim[2].dim_param = "window"
    onnx.save(model, str(bundle / "model.onnx"))
