"""Fixtures of the mars-eval tests: one thread for torch, and a tiny exported bundle."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tiny export runs fastest on one thread, and the test machine's two cores are shared."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def bundle(tiny_bundle):
    """A tiny random Llama exported with B = W = 4 (shared with the other test modules)."""
    return tiny_bundle("llama", 4)[1]
