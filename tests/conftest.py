"""Shared fixtures: tiny exported bundles, the default model exported once per session, the shared data."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from support import SHARED_DATA, export, shared_data_missing
from tiny_models import make_checkpoint


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Torch on one thread: the tiny models run fastest so, and the two cores of the test
    machine are shared with onnxruntime (and with other jobs)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def root_logging_restored():
    """A command run in-process may configure logging for itself (``scripts/gpu_train.py`` calls
    ``logging.basicConfig(force=True)``, ``mars-train`` sets the level to INFO): after the test, its
    handlers (on that test's captured stderr, or a log file) are closed and removed and the root level
    restored, so later tests neither see INFO records nor "--- Logging error ---" on their stderr."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in before and type(h).__module__ != "_pytest.logging"]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


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


@pytest.fixture(scope="session")
def default_mars_bundle(tmp_path_factory):
    """The MARS default model (the shipped adapter merged) exported with B = W = 4."""
    return export("default-mars", tmp_path_factory.mktemp("default-mars") / "bundle", 4, 4)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data folder (support.SHARED_DATA); a test that asks for it (or for a fixture
    using it, or calls support.real_prompts) is skipped, naming the folder and MARS_SHARED_DATA,
    where the folder is missing."""
    missing = shared_data_missing()
    if missing:
        pytest.skip(missing)
    return SHARED_DATA
