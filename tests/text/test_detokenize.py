"""Tier 1: streaming detokenization and stop strings on hand-made text.

The tokenizer is the tiny models' byte-level one (one token per byte, no merges), so every
multi-byte character is split across tokens: the hardest case for streaming.
"""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tokenizer

from runtime.text.detokenize import Detokenizer, StopMatcher, TextStream
from runtime.text.tokenizer import Tokenizer

ADVERSARIAL = ["héllo wörld", "你好，世界", "日本語のテキスト", "😀🤖 ok", "🇫🇷👩‍👩‍👧", "e\u0301 ñ ß Ω", "mixed ascii 和 emoji 🎉!"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("byte-tokenizer")
    make_tokenizer().save_pretrained(path)
    return Tokenizer(path)


def stream(tokenizer, ids, step=1, stops=()):
    text, deltas = TextStream(tokenizer, stops), []
    for i in range(0, len(ids), step):
        deltas.append(text.add(ids[i:i + step]))
        if text.is_stopped:
            return deltas, text
    return deltas + [text.finish()], text


@pytest.mark.parametrize("step", [1, 2, 3, 4])
@pytest.mark.parametrize("text", ADVERSARIAL)
def test_never_splits_a_character(tokenizer, text, step):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: characters span tokens
    deltas, _ = stream(tokenizer, ids, step)
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_random_ids_equal_one_shot_decode(tokenizer):
    """Random bytes (invalid and partial UTF-8 included) and special tokens."""
    rng = random.Random(0)
    vocab = len(make_tokenizer())
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        deltas, _ = stream(tokenizer, ids, rng.randrange(1, 5))
        assert "".join(deltas) == tokenizer.decode(ids)


def test_cut_inside_a_character_finishes_as_decode_does(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # the emoji's last byte is missing
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.add(ids) == "ok "
    assert detokenizer.finish() == tokenizer.decode(ids)[3:] == "\ufffd"


def test_stop_matcher_holds_back_possible_starts():
    matcher = StopMatcher(["END"])
    assert matcher.feed("abcE") == "abc"
    assert matcher.feed("N") == ""
    assert matcher.feed("Dxyz") == "" and matcher.is_stopped


def test_stop_matcher_releases_false_starts_and_flushes():
    matcher = StopMatcher(["END", "STOP"])
    assert matcher.feed("aEN") == "a"
    assert matcher.feed("x ST") == "ENx "
    assert not matcher.is_stopped and matcher.flush() == "ST"


def test_stop_matcher_cuts_at_the_earliest_stop():
    matcher = StopMatcher(["yz", "xy"])
    assert matcher.feed("axyz") == "a" and matcher.is_stopped


def test_stop_matcher_without_stops_passes_text_through():
    matcher = StopMatcher()
    assert matcher.feed("abc") == "abc" and matcher.flush() == ""


@pytest.mark.parametrize("step", [1, 3])
def test_stop_string_of_multibyte_characters_split_across_tokens(tokenizer, step):
    ids = tokenizer.encode("你好世界!", add_special_tokens=False)
    deltas, text = stream(tokenizer, ids, step, stops=["世界"])
    assert "".join(deltas) == "你好" and text.is_stopped


def test_stop_string_found_only_in_the_finish_flush(tokenizer):
    ids = tokenizer.encode("abc 😀", add_special_tokens=False)[:-1]
    deltas, text = stream(tokenizer, ids, stops=["\ufffd"])
    assert "".join(deltas) == "abc " and text.is_stopped
