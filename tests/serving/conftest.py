"""Fixtures of the server tests."""

from __future__ import annotations

import pytest
from server_support import serve


@pytest.fixture(scope="module")
def tiny_server(tiny_bundle):
    """The tiny random Llama (B = W = 4) served with 2 slots and a load policy."""
    _, bundle = tiny_bundle("llama", 4)
    with serve(str(bundle), "--max-batch-size", "2", "--tau-min", "0.5", "--queue-high", "4") as running:
        yield running
