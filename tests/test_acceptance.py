"""Tier 1: the acceptance rule, confidence metrics, KV cache and window mask on hand-made arrays."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from runtime.decode import acceptance
from runtime.decode.acceptance import Confidences, accept, confidence, count_accepted, softmax
from runtime.decode.batch import window_mask
from runtime.decode.kv_cache import KVCache
from runtime.decode.params import DecodeParams

STOP = frozenset({2})


@pytest.mark.parametrize("confs, tau, max_accept, expected", [
    ([0.1, 0.9, 0.9, 0.9], 0.5, 8, 4),   # all masks pass
    ([0.1, 0.9, 0.4, 0.9], 0.5, 8, 2),   # strictly left to right: stops at the first failure
    ([0.1, 0.4, 0.9, 0.9], 0.5, 8, 1),   # the AR token is accepted whatever its confidence
    ([0.1, 0.9, 0.9, 0.9], 0.5, 3, 3),   # bounded by max_accept (block size / budget)
    ([0.1, 0.5, 0.9, 0.9], 0.5, 8, 1),   # confidence must exceed tau, not equal it
    ([1.0, 1.0, 1.0, 1.0], 1.0, 8, 1),   # tau = 1: one token per step even at probability 1
    ([0.0, 0.0, 0.0, 0.0], 0.0, 8, 1),   # tau = 0 still needs a positive confidence
])
def test_count_accepted(confs, tau, max_accept, expected):
    ids = np.array([5, 6, 7, 8])
    assert count_accepted(ids, np.array(confs), tau, max_accept, STOP) == expected


def test_nothing_accepted_after_an_end_token():
    assert count_accepted(np.array([5, 2, 7, 8]), np.ones(4) * 0.99, 0.5, 8, STOP) == 2
    assert count_accepted(np.array([2, 6, 7, 8]), np.ones(4) * 0.99, 0.5, 8, STOP) == 1


def test_confidence_metrics():
    logits = np.log(np.array([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3]], dtype=np.float32))
    np.testing.assert_allclose(confidence(logits, "probability"), [0.7, 1 / 3], rtol=1e-5)
    np.testing.assert_allclose(confidence(logits, "margin"), [0.5, 0.0], atol=1e-6)
    entropy = -(0.7 * np.log(0.7) + 0.2 * np.log(0.2) + 0.1 * np.log(0.1))
    np.testing.assert_allclose(confidence(logits, "entropy"), [1 - entropy / np.log(3), 0.0], atol=1e-5)
    with pytest.raises(ValueError, match="unknown confidence metric"):
        confidence(logits, "nope")


@pytest.mark.parametrize("metric", acceptance.METRICS)
def test_confidences_read_row_by_row_have_the_bits_of_the_whole_step(metric):
    """Row j of Confidences is confidence() of the step's [M, V] logits, bit for bit (the probability metric
    as 1 / sum(exp): the softmax's own max); slices and negative indices read the same rows."""
    logits = np.random.default_rng(0).standard_normal((5, 4099), np.float32) * 6  # [M, V]
    whole = confidence(logits, metric)
    lazy = Confidences(logits, metric)
    assert len(lazy) == 5 and [lazy[j] for j in range(5)] == whole.tolist() and lazy[-1] == whole[-1]
    assert lazy[2:][1] == whole[3] and np.array_equal(np.asarray(lazy), whole)
    if metric == "probability":
        np.testing.assert_array_equal(whole, softmax(logits).max(axis=-1))
    with pytest.raises(IndexError):
        lazy[5]
    with pytest.raises(ValueError, match="unknown confidence metric"):
        Confidences(logits, "nope")


def test_lazy_confidences_meet_tau_in_float32_as_the_eager_array():
    """A confidence equal to float32(tau) is not above tau: compared in float32 (numpy's rule for a float32
    array against a Python float, which the C sample copies), where float64 would accept float32(0.8) > 0.8."""
    logits = np.array([[1.3862941, 0.0]] * 3, np.float32)  # p(argmax) = float32(0.8) in every row
    ids = logits.argmax(-1)
    assert confidence(logits)[1] == np.float32(0.8)
    assert count_accepted(ids, Confidences(logits), 0.8, 8, STOP) == count_accepted(ids, confidence(logits), 0.8, 8,
                                                                                     STOP) == 1


def test_threshold_acceptance_computes_only_the_rows_it_reads(monkeypatch):
    """Row 0 (the exact next token) is never tested and nothing after the first row below tau is read, so a
    step of 4 predictions whose second mask is not confident computes the confidence of rows 1 and 2 only."""
    computed = []
    real = acceptance.confidence
    monkeypatch.setattr(acceptance, "confidence",
                        lambda rows, metric: computed.extend(rows[:, 7].tolist()) or real(rows, metric))
    logits = np.zeros((4, 8), np.float32)  # [M, V]
    logits[:, 3] = [0.0, 9.0, 0.0, 9.0]  # rows 1 and 3 confident (p ~ 0.999), rows 0 and 2 flat
    logits[:, 7] = [0.25, 0.5, 0.75, 1.0]  # tells the rows apart (row 2 stays far below tau)
    got = accept(logits.argmax(-1), Confidences(logits), 0.9, [], 8, STOP, num_real=1, block_size=4, is_block=False)
    assert got.tokens == [7, 3] and computed == [0.5, 0.75]


@pytest.mark.parametrize("kwargs, message", [
    ({"tau": -0.1}, "tau must be a finite number >= 0"),
    ({"tau": float("inf")}, "tau must be a finite number >= 0"),
    ({"tau": float("nan")}, "tau must be a finite number >= 0"),
    ({"metric": "logit"}, "unknown confidence metric"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"block_size": 0}, "block_size must be >= 1"),
])
def test_decode_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeParams(**kwargs)


def test_tau_above_one_is_allowed():
    assert DecodeParams(tau=1.5).tau == 1.5


def test_window_mask_sees_the_committed_keys_then_the_window_at_its_positions():
    mask = window_mask(np.array([2, 0]), 6, 3)  # [n, 1, W, S]: row 0 holds 2 entries, row 1 none
    assert mask.shape == (2, 1, 3, 6) and mask.dtype == bool
    expected = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=bool)
    np.testing.assert_array_equal(mask[0, 0], expected)
    assert window_mask(np.array([0]), 2, 2)[0, 0].tolist() == [[True, False], [True, True]]
    np.testing.assert_array_equal(mask[1, 0], np.tril(np.ones((3, 6), bool)))


def test_kv_cache_commits_only_real_positions():
    """Presents in the cache's layout (entries at their positions) are copied from the slot's length on,
    ``count`` of them."""
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, max_len=6, dtype=np.float32)
    new = [(np.full((1, 1, 6, 2), 10.0 * layer + np.arange(6)[None, None, :, None]),
            np.full((1, 1, 6, 2), -1.0)) for layer in range(2)]
    cache.commit(new, [3])  # a window of 4 at positions 0..3, only 3 real tokens
    assert cache.lengths.tolist() == [3] and cache.capacity == 6
    np.testing.assert_array_equal(cache.past(1)[1][0][0, 0, :3, 0], [10, 11, 12])
    cache.commit(new, [2])
    np.testing.assert_array_equal(cache.past(1)[0][0][0, 0, :, 0], [0, 1, 2, 3, 4, 0])
    with pytest.raises(ValueError, match="KV cache overflow"):
        cache.commit(new, [2])
    with pytest.raises(ValueError, match="KV cache overflow"):
        cache.reserve(7)


def test_kv_cache_commit_of_its_own_buffers_only_counts():
    """A step that wrote into the cache (presents = its views) is committed without a copy."""
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=16, dtype=np.float32, num_slots=2)
    presents = cache.past(2)
    presents[0][0][1, 0, :3] = 7.0  # as the step writes row 1's window
    before = cache.keys[0].copy()
    cache.commit(presents, [0, 3])
    assert cache.lengths.tolist() == [0, 3] and np.array_equal(cache.keys[0], before)


def test_kv_cache_rows_advance_independently_and_past_is_a_view():
    cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=3, max_len=1000, dtype=np.float32, num_slots=3)
    cache.reserve(40)
    assert cache.capacity == 64  # doubled from 16 until it fits
    new = [(np.arange(2 * 2 * 6 * 3, dtype=np.float32).reshape(2, 2, 6, 3), np.ones((2, 2, 6, 3), np.float32))]
    cache.commit(new, [4, 1])
    cache.commit(new, [0, 2])
    assert cache.lengths.tolist() == [4, 3, 0]
    key = cache.past(2)[0][0]
    assert key.shape == (2, 2, 64, 3) and np.shares_memory(key, cache.keys[0])  # no copy of the past
    np.testing.assert_array_equal(key[1, :, :3], new[0][0][1, :, :3])  # positions 0, then 1..2
    cache.reserve(200)  # growing keeps the committed prefix
    assert cache.capacity == 256
    np.testing.assert_array_equal(cache.past(2)[0][0][1, :, :3], key[1, :, :3])
    cache.free(0)
    cache.free(1)
    cache.reserve(20)  # every row short again: the buffers shrink
    assert cache.capacity == 64  # halved while the longest row (20) fits in a quarter


def test_kv_cache_hands_the_same_views_until_its_buffers_change():
    """The step's binding knows the cache by the identity of its views (runtime.backends.kv_binding), so they are
    made once per set of buffers, and anew once the buffers are reallocated."""
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, max_len=256, dtype=np.float32, num_slots=3)
    first, again = cache.past(2), cache.past(2)
    assert first is not again  # a caller may change its list
    assert all(a is b for pair, other in zip(first, again) for a, b in zip(pair, other))
    assert cache.past_of(1)[1][1] is cache.past_of(1)[1][1] and cache.past_of(1)[1][1] is not cache.past_of(2)[1][1]
    cache.reserve(40)  # reallocated
    grown = cache.past(2)
    assert grown[0][0] is not first[0][0] and grown[0][0].shape == (2, 1, 64, 2)
    assert np.shares_memory(grown[1][1], cache.values[1]) and np.shares_memory(cache.past_of(1)[0][0], cache.keys[0])
    for copied in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):  # views of the copy's own buffers
        assert np.shares_memory(copied.past(2)[0][0], copied.keys[0])
        assert not np.shares_memory(copied.past(2)[0][0], cache.keys[0])


def test_kv_cache_commit_slot_appends_a_whole_prefill_chunk_to_one_slot():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=64, dtype=np.float32, num_slots=3)
    cache.commit([(np.ones((2, 1, 4, 2), np.float32), np.ones((2, 1, 4, 2), np.float32))], [2, 1])
    chunk = [(np.arange(8, dtype=np.float32).reshape(1, 1, 8, 1).repeat(2, -1), np.zeros((1, 1, 8, 2), np.float32))]
    cache.commit_slot(1, chunk, 0, 5)  # positions 1..5 of the chunk's presents
    assert cache.lengths.tolist() == [2, 6, 0]  # only slot 1 moved
    past = cache.past_of(1)  # the slot's own buffers (a prefill's past, written in place), C-contiguous
    assert past[0][0].shape == (1, 1, 16, 2) and past[0][0].flags.c_contiguous
    assert np.shares_memory(past[0][0], cache.keys[0])
    np.testing.assert_array_equal(past[0][0][0, 0, :6, 0], [1, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(cache.keys[0][0, 0, :2, 0], [1, 1])  # slot 0 untouched
    with pytest.raises(ValueError, match="KV cache overflow"):
        cache.commit_slot(1, [(np.zeros((1, 1, 20, 2), np.float32),) * 2], 0, 11)
