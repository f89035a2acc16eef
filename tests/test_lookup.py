"""Tier 1, hand-made token lists: prompt-lookup drafts (runtime.decode.lookup) and how a sequence picks its drafts."""

from __future__ import annotations

import random

import pytest

from runtime.decode.lookup import NgramIndex
from runtime.decode.params import DecodeParams
from runtime.decode.sequence import Sequence


def scan_propose(context: list[int], max_drafts: int, max_n: int, min_n: int) -> list[int]:
    """The rule of runtime.decode.lookup by brute force: rescan the whole context for each n."""
    length = len(context)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = context[length - n:]
        ends = [e for e in range(n, length) if context[e - n:e] == suffix]
        if ends:
            extended = list(context)
            for i in range(max_drafts):
                extended.append(extended[ends[-1] + i])
            return extended[length:]
    return []


@pytest.mark.parametrize("context, max_drafts, expected", [
    ([5, 6, 7, 8, 5, 6], 3, [7, 8, 5]),           # suffix 5 6 occurred before: what followed it
    ([1, 2, 9, 1, 2, 3, 4, 1, 2], 2, [3, 4]),     # the latest earlier match wins
    ([1, 2, 3, 9, 2, 3, 4, 7, 1, 2, 3], 2, [9, 2]),  # the longest suffix n-gram wins over a later shorter one
    ([4, 4, 4], 5, [4, 4, 4, 4, 4]),              # a loop keeps copying its own proposal
    ([3, 1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),        # period 2
    ([1, 2, 3, 4], 3, []),                        # no repeated n-gram: no proposal
    ([7], 3, []),                                 # one token: nothing earlier
    ([5, 6, 5], 0, []),                           # no room for drafts
])
def test_propose_hand_made(context, max_drafts, expected):
    assert NgramIndex(context).propose(max_drafts) == expected


def test_min_n_refuses_short_matches():
    assert NgramIndex([1, 2, 3, 1], max_n=3, min_n=2).propose(2) == []
    assert NgramIndex([1, 2, 3, 1], max_n=3, min_n=1).propose(2) == [2, 3]


@pytest.mark.parametrize("max_n, min_n", [(4, 1), (3, 2), (1, 1)])
def test_incremental_index_equals_rescanning(max_n, min_n):
    """Appending tokens a few at a time gives at every step the proposal of a full rescan."""
    rng = random.Random(0)
    for _ in range(20):
        tokens = [rng.randrange(6) for _ in range(80)]  # a small vocabulary: many repeats
        index = NgramIndex(tokens[:3], max_n, min_n)
        length = 3
        while length < len(tokens):
            assert index.propose(5) == scan_propose(tokens[:length], 5, max_n, min_n)
            step = rng.randrange(1, 4)
            index.extend(tokens[length:length + step])
            length = min(length + step, len(tokens))
        assert index.token_ids == tokens


def test_bad_ngram_bounds_are_refused():
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramIndex([1, 2], max_n=2, min_n=3)


def make_sequence(draft: str, prompt: list[int], block_size: int = 4, max_new: int = 16) -> Sequence:
    return Sequence("r", prompt, DecodeParams(mode="verify", draft=draft, max_new_tokens=max_new), block_size,
                    frozenset({0}))


def test_sequence_drafts_follow_the_draft_source():
    prompt = [9, 5, 6, 7, 8, 5, 6]  # the suffix 5 6 proposes 7 8 5
    masks, lookup, both = (make_sequence(d, prompt) for d in ("masks", "lookup", "both"))
    for seq in (masks, lookup, both):
        seq.mask_drafts = [1, 2, 3]
        seq.prepare_drafts()
    assert (masks.drafts, lookup.drafts, both.drafts) == ([1, 2, 3], [7, 8, 5], [7, 8, 5])
    for seq in (masks, lookup, both):
        seq.add_tokens([4])  # 4 never occurred: no lookup proposal now
        seq.prepare_drafts()
    assert (masks.drafts, lookup.drafts, both.drafts) == ([1, 2, 3], [], [1, 2, 3])
    assert masks.lookup is None and lookup.lookup.token_ids == prompt + [4]


def test_sequence_drafts_stop_at_the_token_budget():
    seq = make_sequence("lookup", [3, 3, 3], max_new=3)
    seq.prepare_drafts()
    assert seq.drafts == [3, 3]  # 3 tokens left: one step yields at most 3, so 2 drafts
    seq.add_tokens([3, 3])
    seq.prepare_drafts()
    assert seq.drafts == []


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "verify", "draft": "ngram"}, "unknown draft source 'ngram'"),
    ({"mode": "ar", "draft": "lookup"}, "draft 'lookup' needs mode 'verify' or 'threshold'"),
    ({"mode": "ar", "draft": "both"}, "draft 'both' needs mode 'verify' or 'threshold'"),
    ({"mode": "threshold", "draft": "lookup", "temperature": 0.7}, "draft 'lookup' is greedy only"),
])
def test_decode_params_reject_bad_draft_sources(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeParams(**kwargs)
