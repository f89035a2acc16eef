"""Fixtures of the mars-eval tests: a tiny exported bundle."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def bundle(tiny_bundle):
    """A tiny random Llama exported with B = W = 4 (shared with the other test modules)."""
    return tiny_bundle("llama", 4)[1]
