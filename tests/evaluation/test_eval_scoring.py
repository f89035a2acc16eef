"""Agreement scores and summary rows on hand-made records."""

from __future__ import annotations

import pytest

from runtime.evaluation.plot import (LABEL_PLACES, make_tpf_figure, place_labels, plot_tpf_quality, tau_labels,
                                     tpf_lines)
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


def summary_row(tau, tpf, quality, draft="masks"):
    """A summary row on the plot: every panel's metric at ``quality``."""
    return {"bundle": "b", "block_size": 4, "draft": draft, "adaptive_masks": False, "tau": tau, "tpf": tpf,
            **dict.fromkeys(["gsm8k_accuracy", "humaneval_pass_at_1", "agreement_exact", "agreement_prefix"], quality)}


def test_tau_labels_share_a_point_that_coincides_and_skip_a_point_without_a_value():
    ar = summary_row(1.0, 1.0, 1.0)
    rows = [ar, summary_row(0.95, 1.0, 1.0), summary_row(0.9, 1.03, 0.97), ar,  # the AR row on a second line
            {**summary_row(0.3, 2.5, 0.2), "agreement_exact": None}]
    assert tau_labels(rows, "agreement_exact") == {(1.0, 1.0): "1, 0.95", (1.03, 0.97): "0.9"}


def test_labels_close_together_are_placed_apart():
    """Plain data: a label takes the first place its neighbours leave free; a crowd pushes the later ones out."""
    assert place_labels([(0, 0), (100, 0)], ["1", "0.9"]) == [LABEL_PLACES[0], LABEL_PLACES[0]]  # far apart
    assert place_labels([(0, 0), (1, 0)], ["1", "0.9"]) == [LABEL_PLACES[0], LABEL_PLACES[1]]
    crowd = place_labels([(i, 0) for i in range(6)], ["1", "0.95", "0.9", "0.8", "0.7", "0.6"])  # 1 point apart
    assert crowd[:4] == list(LABEL_PLACES)  # every place round the first points taken,
    assert crowd[4] == ((11, 11), "left", "bottom")  # so the fifth moves out by a line height (7 points),
    assert crowd[5] == LABEL_PLACES[0]  # and the sixth, 5 points on, has room above right again


def test_the_tau_labels_of_points_close_together_do_not_touch(tmp_path):
    """"1" and "0.9" at TPF 1.0 and 1.02 were drawn up right of each point and read as "10.9". No two labels' drawn
    boxes meet now (checked on the rendered figure, not its pixels), also in a crowd of points, and the PNG is
    written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    summary = [summary_row(1.0, 1.0, 1.0), summary_row(0.95, 1.01, 1.0), summary_row(0.9, 1.02, 1.0),
               summary_row(0.8, 1.05, 0.99), summary_row(0.7, 2.0, 0.8), summary_row(0.5, 3.2, 0.6),
               summary_row(1.0, 1.0, 1.0, "both"), summary_row(0.9, 1.03, 0.99, "both"),
               summary_row(0.5, 3.0, 0.6, "both")]
    fig = make_tpf_figure(summary)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        assert sorted(t.get_text() for t in ax.texts) == ["0.5", "0.5", "0.7", "0.8", "0.9", "0.9", "0.95", "1"]
        boxes = [t.get_window_extent(renderer).padded(1) for t in ax.texts]
        assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
    assert plot_tpf_quality(tmp_path, summary).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
