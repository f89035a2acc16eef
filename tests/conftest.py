"""Shared fixtures: tiny exported bundles, and the default model exported once per session."""

from __future__ import annotations

import pytest
from support import export
from tiny_models import make_checkpoint


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
