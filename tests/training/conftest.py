"""Fixtures of the training tests (the models and tokenizer come from :mod:`tiny_mars`)."""

from __future__ import annotations

import json

import pytest
from tiny_mars import make_model, make_tokenizer
from transformers import PreTrainedTokenizerFast


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A saved tiny model + tokenizer directory that ``load_model`` accepts."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_model().save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_jsonl(tmp_path_factory) -> str:
    """Eight short chat examples in the accepted record formats."""
    path = tmp_path_factory.mktemp("data") / "tiny.jsonl"
    records = []
    for i in range(4):
        records.append({"messages": [{"role": "user", "content": f"add {i} and {i}"},
                                     {"role": "assistant", "content": f"{i} + {i} = {2 * i}"}]})
        records.append({"question": f"What is {i} times 3?", "answer": f"It is {3 * i}.\n#### {3 * i}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)

