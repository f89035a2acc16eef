"""Agreement scores and summary rows on hand-made records."""

from __future__ import annotations

import pytest

from runtime.evaluation.plot import tpf_lines
from runtime.evaluation.runner import plan_block_sizes, plan_runs, plan_taus
from runtime.evaluation.scoring import common_prefix, score_agreement
from runtime.evaluation.summary import draft_label, summarize


def record(tau, item_id, ids, forwards, decode_seconds, block_size=4, task="gsm8k", draft="masks", **scores):
    return {"bundle": "b", "block_size": block_size, "tau": tau, "draft": draft, "task": task, "item_id": item_id,
            "token_ids": ids, "num_tokens": len(ids), "num_forwards": forwards, "decode_seconds": decode_seconds,
            **scores}


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([7, 8], [7, 8]) == 2


def test_agreement_against_the_ar_record_of_the_same_prompt():
    records = [record(1.0, "p", [1, 2, 3, 4], 4, 1.0), record(0.5, "p", [1, 2, 9], 2, 0.5),
               record(0.5, "q", [5], 1, 0.1), record(1.0, "q", [5], 1, 0.1)]
    score_agreement(records)
    assert [r["identical_to_ar"] for r in records] == [True, False, True, True]
    assert [r["common_prefix_fraction"] for r in records] == [1.0, 0.5, 1.0, 1.0]  # 2 common of max(4, 3)


def test_a_draft_sources_tau_one_row_is_scored_against_plain_ar():
    records = [record(1.0, "p", [1, 2, 3, 4], 4, 1.0, task="chat"),
               record(1.0, "p", [1, 2, 3, 5], 2, 0.25, task="chat", draft="both"),
               record(0.5, "p", [1, 2, 3, 4], 1, 0.2, task="chat", draft="both")]
    score_agreement(records)
    assert [r["identical_to_ar"] for r in records] == [True, False, True]
    ar, lossless, fast = summarize(records)
    assert [(r["tau"], r["draft"]) for r in (ar, lossless, fast)] == [(1.0, "masks"), (1.0, "both"), (0.5, "both")]
    assert (ar["speedup_vs_ar"], lossless["speedup_vs_ar"], fast["speedup_vs_ar"]) == (1.0, 4.0, 5.0)


def test_plan_runs():
    assert plan_runs([1.0, 0.9], "masks") == [(1.0, "masks", False), (0.9, "masks", False)]
    assert plan_runs([1.0, 0.9, 0.5], "both") == [(1.0, "masks", False), (1.0, "both", False), (0.9, "both", False),
                                                  (0.5, "both", False)]
    assert plan_runs([0.9, 1.0], "lookup") == [(0.9, "lookup", False), (1.0, "masks", False), (1.0, "lookup", False)]


def test_plan_runs_adds_an_adaptive_twin_after_each_run_that_feeds_masks():
    assert plan_runs([1.0, 0.9], "masks", adaptive_masks=True) == [
        (1.0, "masks", False), (0.9, "masks", False), (0.9, "masks", True)]
    assert plan_runs([1.0, 0.5], "both", adaptive_masks=True) == [  # tau 1 with 'both' feeds mask drafts
        (1.0, "masks", False), (1.0, "both", False), (1.0, "both", True), (0.5, "both", False), (0.5, "both", True)]
    assert plan_runs([1.0, 0.5], "lookup", adaptive_masks=True) == [  # tau 1 with lookup drafts feeds no masks
        (1.0, "masks", False), (1.0, "lookup", False), (0.5, "lookup", False), (0.5, "lookup", True)]


def test_adaptive_rows_follow_their_fixed_twin_with_a_label_and_plot_line_of_their_own():
    records = [record(0.5, "p", [1, 2], 1, 0.5, task="chat", adaptive_masks=True),
               record(1.0, "p", [1, 2], 2, 1.0, task="chat"),  # these two as written before the field existed
               record(0.5, "p", [1, 2], 1, 0.25, task="chat")]
    score_agreement(records)
    rows = summarize(records)
    assert [(r["tau"], r["adaptive_masks"]) for r in rows] == [(1.0, False), (0.5, False), (0.5, True)]
    assert [r["speedup_vs_ar"] for r in rows] == [1.0, 4.0, 2.0]
    assert [draft_label(r) for r in rows] == ["masks", "masks", "masks adaptive"]
    ar, fixed, adaptive = rows  # the AR point (no masks fed: the same with adaptive masks) starts both lines
    assert tpf_lines(rows) == {"b B=4": [ar, fixed], "b B=4 +masks adaptive": [ar, adaptive]}


def test_summary_uses_ratios_of_totals():
    records = [record(1.0, "p", [1] * 4, 4, 1.0, correct=True), record(1.0, "q", [1] * 2, 2, 1.0, correct=False),
               record(0.5, "p", [1] * 4, 1, 0.5, correct=True), record(0.5, "q", [1] * 2, 2, 0.5, correct=True)]
    score_agreement(records)
    ar, fast = summarize(records)
    assert (ar["tau"], fast["tau"]) == (1.0, 0.5)
    assert fast["tpf"] == 6 / 3  # not the mean of the per-prompt TPFs (2.5)
    assert fast["tokens_per_second"] == 6 / 1.0 and ar["tokens_per_second"] == 6 / 2.0
    assert fast["speedup_vs_ar"] == 2.0 and ar["speedup_vs_ar"] == 1.0
    assert ar["gsm8k_accuracy"] == 0.5 and fast["gsm8k_accuracy"] == 1.0
    assert fast["humaneval_pass_at_1"] is None and fast["num_humaneval"] == 0


def test_plans():
    assert plan_taus([0.9, 0.5]) == [1.0, 0.9, 0.5] and plan_taus([0.9, 1.5]) == [0.9, 1.5]
    assert plan_block_sizes(None, 8) == [4, 8] and plan_block_sizes(None, 4) == [4] and plan_block_sizes(None, 2) == [2]
    assert plan_block_sizes([2, 8], 4) == [2]
    with pytest.raises(ValueError, match="none of the block sizes"):
        plan_block_sizes([8, 16], 4)
