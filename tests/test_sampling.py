"""Tier 1, hand-made arrays: sampling filters, the verify-mode rule, the scheduler, the batch mask."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.decode.acceptance import accept, count_verified
from runtime.decode.batch import window_mask
from runtime.decode.params import DecodeParams, ParamError
from runtime.decode.sampling import MIN_TEMPERATURE, filtered_probs, sample, select
from runtime.decode.scheduler import Scheduler
from runtime.decode.sequence import Sequence

LOGITS = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))  # [1, 4]


def test_top_k_and_top_p_keep_the_right_tokens():
    np.testing.assert_allclose(filtered_probs(LOGITS, 1.0, 2, 1.0), [[0.625, 0.375, 0, 0]], atol=1e-6)
    # top-p 0.8: 0.5 + 0.3 reaches 0.8, so the third token is cut
    np.testing.assert_allclose(filtered_probs(LOGITS, 1.0, 0, 0.8), [[0.625, 0.375, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(filtered_probs(LOGITS, 1.0, 0, 0.81), [[0.5, 0.3, 0.15, 0]] / np.float32(0.95),
                               atol=1e-6)
    np.testing.assert_allclose(filtered_probs(LOGITS, 1.0, 0, 0.3), [[1, 0, 0, 0]], atol=1e-6)
    hot = filtered_probs(LOGITS, 2.0, 0, 1.0)[0]  # temperature 2 flattens: p ~ sqrt(p)
    np.testing.assert_allclose(hot, np.sqrt([0.5, 0.3, 0.15, 0.05]) / np.sqrt([0.5, 0.3, 0.15, 0.05]).sum(), atol=1e-6)


def test_sample_follows_the_distribution_and_never_picks_a_cut_token():
    probs = filtered_probs(np.repeat(LOGITS, 20000, axis=0), 1.0, 3, 1.0)  # [20000, 4]
    ids = sample(probs, np.random.default_rng(0))
    np.testing.assert_allclose(np.bincount(ids, minlength=4) / len(ids), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
                               atol=0.01)


def test_select_greedy_and_sampled_confidence():
    ids, conf = select(LOGITS, 0.0, 0, 1.0, "probability", None)
    assert ids.tolist() == [0] and conf[0] == pytest.approx(0.5)
    for tiny in (1e-38, MIN_TEMPERATURE / 2):  # below MIN_TEMPERATURE: greedy, no rng needed, finite confidence
        assert [np.asarray(a).tolist() for a in select(LOGITS, tiny, 0, 1.0, "probability", None)] == \
            [ids.tolist(), np.asarray(conf).tolist()]
    ids, conf = select(LOGITS, 1.0, 2, 1.0, "probability", np.random.default_rng(0))
    assert ids[0] in (0, 1) and conf[0] == pytest.approx(0.5)  # top-k shapes the draw, not the confidence
    assert select(LOGITS, 0.0, 0, 1.0, "probability", None, with_confidence=False)[1].tolist() == [0.0]


@pytest.mark.parametrize("metric", ["probability", "margin", "entropy"])
def test_sampled_confidence_is_the_untempered_models_whatever_the_sampling_settings(metric):
    """tau tests the model's own distribution: a small temperature (which makes the distribution
    drawn from nearly one-hot) or top-k / top-p never make a prediction look more confident."""
    greedy = select(LOGITS, 0.0, 0, 1.0, metric, None)[1]
    for temperature, top_k, top_p in [(0.05, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 2, 1.0), (0.05, 0, 0.6)]:
        conf = select(LOGITS, temperature, top_k, top_p, metric, np.random.default_rng(0))[1]
        np.testing.assert_allclose(conf, greedy, rtol=1e-6, err_msg=f"T={temperature} top_k={top_k} top_p={top_p}")
    assert select(LOGITS, 0.05, 0, 1.0, "probability", np.random.default_rng(0))[1][0] == pytest.approx(0.5)


@pytest.mark.parametrize("drafts, predicted, max_accept, expected", [
    ([], [7, 1, 2], 4, 1),                # no drafts: the AR token only
    ([7, 8, 9], [7, 8, 9, 4], 4, 4),      # every draft kept, plus the token after the last
    ([7, 5, 9], [7, 8, 9, 4], 4, 2),      # second draft wrong: keep 7, then the correction 8
    ([5, 8, 9], [7, 8, 9, 4], 4, 1),      # first draft wrong: the correction 7 only
    ([7, 8, 9], [7, 8, 9, 4], 2, 2),      # capped by the block size / remaining budget
    ([2, 8], [2, 8, 3], 4, 1),            # 2 is an end token: nothing after it
])
def test_count_verified(drafts, predicted, max_accept, expected):
    assert count_verified(drafts, np.array(predicted), max_accept, frozenset({2})) == expected


@pytest.mark.parametrize("drafts, predicted, confidences, tau, tokens, committed, mask_drafts", [
    ([], [7, 1, 3, 4], [0, .9, .9, .1], 0.5, [7, 1, 3], 2, [4]),                 # no drafts: plain threshold
    ([7, 8], [7, 8, 9, 1, 3], [0, 0, 0, .9, .1], 0.5, [7, 8, 9, 1], 4, [3]),    # drafts kept, then a mask by tau
    ([7, 5], [7, 8, 9, 1, 3], [0, 0, 0, .9, .9], 0.5, [7, 8], 3, []),           # a wrong draft: its correction ends it
    ([7, 8], [7, 8, 9, 1, 3], [0, 0, 0, .9, .9], 1.0, [7, 8, 9], 4, [1, 3]),    # tau 1 (verify): the exact token only
    ([7, 2], [7, 2, 9, 1, 3], [0, 0, 0, .9, .9], 0.5, [7, 2], 3, []),           # an end token: nothing after it
])
def test_accept_keeps_drafts_then_masks_by_tau(drafts, predicted, confidences, tau, tokens, committed, mask_drafts):
    args = (np.array(predicted), np.array(confidences, np.float32), tau, drafts, 4, frozenset({2}), 2, 4)
    accepted = accept(*args, is_block=False)
    assert (accepted.tokens, accepted.num_committed, accepted.mask_drafts) == (tokens, committed, mask_drafts)
    assert accept(*args, is_block=True).num_committed == 0  # an open block commits nothing


def test_scheduler_admits_fifo_into_the_lowest_free_slots():
    seqs = [Sequence(str(i), [1, 2], DecodeParams(), 4, frozenset({0})) for i in range(4)]
    scheduler = Scheduler(num_slots=3, window=4, scheme="block")
    for seq in seqs:
        scheduler.add(seq)
    assert [s.request_id for s in scheduler.schedule(1.0).rows] == ["0", "1", "2"] and scheduler.num_rows == 3
    scheduler.finish(seqs[0])
    assert scheduler.num_rows == 3  # slot 0 free: an idle row inside the batch
    seqs[1].uncached = [5, 6]  # inside a block: the block scheme admits only at a block boundary
    assert scheduler.schedule(1.0).rows == seqs[1:3]
    seqs[1].uncached = [6]
    assert [s.slot for s in scheduler.schedule(1.0).rows] == [0, 1, 2] and seqs[3].slot == 0
    scheduler.finish(seqs[2])
    assert scheduler.num_rows == 2 and scheduler.find("2") is None and scheduler.find("3") is seqs[3]


def test_window_mask_per_row_lengths():
    mask = window_mask(np.array([2, 0]), capacity=6, window=2)  # [2, 1, 2, 6]: the window at positions 2..3, 0..1
    assert mask.shape == (2, 1, 2, 6)
    np.testing.assert_array_equal(mask[0, 0], [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(mask[1, 0], [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fast"}, "unknown mode"),
    ({"temperature": -1}, "temperature must be"),
    ({"top_p": 0}, "top_p must be in"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"mode": "verify", "temperature": 0.7}, "verify mode is greedy only"),
])
def test_decode_params_reject_bad_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeParams(**kwargs)


def test_a_seed_is_any_integer_at_least_zero():
    """Python and numpy integers are seeds; a bool, a float or a negative number is refused naming ``seed``."""
    assert DecodeParams(seed=np.int64(3)).seed == 3 and DecodeParams(seed=0).seed == 0
    for bad in (True, 2.0, -1, "1"):
        with pytest.raises(ParamError, match="seed must be an integer >= 0"):
            DecodeParams(seed=bad)
