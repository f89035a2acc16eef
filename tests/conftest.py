"""Shared fixtures: tiny exported bundles, and the default model exported once per session."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_checkpoint  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def export(model: str, out: Path, block: int, window: int, *extra: str) -> Path:
    from mars_export.cli import main
    assert main([model, "-o", str(out), "--block", str(block), "--window", str(window), *extra]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory):
    """Factory: (arch, window) -> (checkpoint dir, bundle dir), each exported once per session."""
    made = {}

    def get(arch: str, window: int):
        if (arch, window) not in made:
            root = tmp_path_factory.mktemp(f"{arch}-w{window}")
            ckpt = make_checkpoint(arch, root / "ckpt")
            made[arch, window] = ckpt, export(str(ckpt), root / "bundle", window, window, "--mask-token", "<mask>")
        return made[arch, window]

    return get


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory):
    """The default model exported with B = W = 8 (downloads it once into the user cache)."""
    return export("default", tmp_path_factory.mktemp("default") / "bundle", 8, 8)


def real_prompts(num_each: int) -> list[tuple[str, str]]:
    """(kind, text) of the first ``num_each`` GSM8K test questions and HumanEval prompts."""
    import gzip
    gsm8k = [json.loads(line)["question"] for line in (SHARED_DATA / "gsm8k/test.jsonl").open()][:num_each]
    with gzip.open(SHARED_DATA / "humaneval/HumanEval.jsonl.gz", "rt") as f:
        humaneval = [json.loads(line)["prompt"] for line in f][:num_each]
    return [("gsm8k", q) for q in gsm8k] + [("humaneval", p) for p in humaneval]
