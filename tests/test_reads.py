"""runtime.decode.reads: which window positions a row reads and what a forward asks the backend for, on hand-made
rows (no model). W = 4, mask token 99, vocabulary 100; a row's solo width comes from a continuous-scheme
scheduler over a dynamic window (:meth:`Scheduler.solo_width`), as the engine asks it."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.bundle import GREEDY_HEAD_MAX_ROWS
from runtime.decode.params import DecodeParams
from runtime.decode.reads import choose_head, first_read_position, gate_tau, gate_taus, read_inputs, reads_ids_only
from runtime.decode.scheduler import Scheduler
from runtime.decode.sequence import Sequence

W, MASK, PAD, V = 4, 99, 0, 100
SCHEDULER = Scheduler(num_slots=4, window=W, scheme="continuous", is_window_dynamic=True)


def row(slot: int = 0, uncached=(7,), drafts=(), block_size: int = W, backing_off: bool = False,
        **params) -> Sequence:
    """A decoding row in ``slot`` with ``uncached`` real tokens and ``drafts``."""
    seq = Sequence(f"r{slot}", [5, 6], DecodeParams(adaptive_masks=backing_off, **params), block_size, frozenset())
    seq.slot, seq.num_prefilled, seq.uncached, seq.drafts = slot, 1, list(uncached), list(drafts)
    if backing_off:
        seq.mask_backoff.skip = 1  # its last masked step gained nothing: the next one feeds no masks
    return seq


def reads(seq: Sequence, width: int = W, default_tau: float = 1.0) -> tuple:
    """(read_inputs, first_read_position, reads_ids_only) of ``seq`` in a step of ``width``, as the engine calls them."""
    solo, tau = SCHEDULER.solo_width(seq, default_tau), seq.tau(default_tau)
    return read_inputs(seq, width, solo), first_read_position(seq, width, solo), reads_ids_only(seq, width, tau, solo)


@pytest.mark.parametrize("seq, width, expected", [
    (row(mode="ar"), W, ((1, 0, 1), None, True)),                               # AR: one real token, no mask fed
    (row(mode="ar"), 1, ((1, 0, 1), None, True)),
    (row(mode="verify", drafts=[11, 12]), W, ((1, 2, 4), 3, True)),             # verify: argmaxes only (tau 1)
    (row(tau=0.9), W, ((1, 0, 4), 1, False)),                                   # threshold below 1: reads mask 1
    (row(tau=1.0), W, ((1, 0, 1), None, True)),                                 # threshold at 1: AR
    (row(tau=0.9, uncached=[7, 8, 9]), W, ((3, 0, 4), 3, False)),               # three real tokens, one mask read
    (row(tau=0.9, uncached=[7, 8, 9]), 2, ((2, 0, 2), None, True)),             # the window holds real tokens only
    (row(tau=0.9, backing_off=True), W, ((1, 0, 1), None, True)),               # backing off: a wider batch's masks
    (row(tau=0.9, block_size=1), W, ((1, 0, 1), None, True)),                   # block size 1: one token a step
    (row(tau=0.9, draft="lookup", drafts=[20, 21]), W, ((1, 2, 4), 3, False)),  # lookup drafts, then a mask
    (row(tau=0.9, draft="lookup", drafts=[20, 21, 22]), 2, ((1, 1, 2), None, True)),  # drafts cut by the width
    (row(tau=0.9, temperature=0.7), W, ((1, 0, 4), 1, False)),                  # sampling reads its logits
    (row(tau=1.0, temperature=0.7), W, ((1, 0, 1), None, False)),               # even where no mask is read
])
def test_a_row_reads_its_real_tokens_drafts_and_masks_up_to_its_solo_width(seq, width, expected):
    assert reads(seq, width) == expected


def test_a_row_reads_only_its_solo_width_in_a_wider_step_and_the_default_tau_is_live():
    seq = row(tau=None)
    assert reads(seq, W, default_tau=1.0) == ((1, 0, 1), None, True)
    assert reads(seq, W, default_tau=0.5) == ((1, 0, 4), 1, False)
    fixed = Scheduler(num_slots=1, window=W, scheme="block", is_window_dynamic=True)  # every step W wide
    assert read_inputs(row(mode="ar"), W, fixed.solo_width(row(mode="ar"), 1.0)) == (1, 0, 4)


def test_a_prefilling_row_reads_ids_only():
    seq = Sequence("p", [1, 2, 3, 4, 5, 6], DecodeParams(tau=0.5, temperature=0.7), W, frozenset())
    assert seq.is_prefilling and reads_ids_only(seq, W, 0.5, W)


def gate(seq: Sequence, ids: list[int]) -> np.float32 | None:
    return gate_tau(seq, ids, W, seq.tau(1.0), SCHEDULER.solo_width(seq, 1.0), MASK, V)


def test_the_gate_takes_a_threshold_rows_tau_rounded_down_to_float32():
    assert gate(row(tau=0.9), [7, MASK, MASK, MASK]) == np.float32(0.9)  # float32(0.9) < 0.9 already
    tau32 = gate(row(tau=0.1), [7, MASK, MASK, MASK])                      # float32(0.1) > 0.1: one step down
    assert tau32.dtype == np.float32 and float(tau32) < 0.1 < float(np.nextafter(tau32, np.float32(1)))
    assert gate(row(tau=0.9, draft="lookup", drafts=[20, 21]), [7, 20, 21, MASK]) == np.float32(0.9)


@pytest.mark.parametrize("seq, ids", [
    (row(mode="ar"), [7, PAD, PAD, PAD]),
    (row(mode="verify", drafts=[11, 12]), [7, 11, 12, MASK]),
    (row(tau=0.9, backing_off=True), [7, MASK, MASK, MASK]),
    (row(tau=0.9, block_size=1), [7, MASK, MASK, MASK]),
])
def test_the_gate_never_tests_a_row_reading_no_confidence(seq, ids):
    assert gate(seq, ids) == np.float32(1)


@pytest.mark.parametrize("seq, ids", [
    (row(tau=0.9, temperature=0.7), [7, MASK, MASK, MASK]),              # samples
    (row(tau=0.9, metric="margin"), [7, MASK, MASK, MASK]),              # another metric
    (row(tau=0.009), [7, MASK, MASK, MASK]),                             # tau < 1 / V: every probability passes
    (row(tau=0.9, draft="lookup", drafts=[20, MASK]), [7, 20, MASK, MASK]),  # a draft equal to the mask token
])
def test_the_gate_refuses_a_row_whose_logits_are_read(seq, ids):
    assert gate(seq, ids) is None


def step(*seqs: Sequence, num_rows: int = 2) -> tuple[list[Sequence], list, list[float], list[int]]:
    """The engine's view of a step over ``seqs``: rows, their ids by slot, taus and solo widths."""
    ids: list[list[int] | None] = [None] * num_rows
    for seq in seqs:
        ids[seq.slot] = seq.step_ids(W, MASK, PAD)
    return list(seqs), ids, [s.tau(1.0) for s in seqs], [SCHEDULER.solo_width(s, 1.0) for s in seqs]


def test_gate_taus_give_an_idle_slot_1_and_fail_with_any_row():
    rows, ids, taus, solos = step(row(0, tau=0.5), row(2, mode="ar"), num_rows=3)
    assert gate_taus(rows, ids, W, taus, solos, MASK, V).tolist() == [np.float32(0.5), 1.0, 1.0]
    rows, ids, taus, solos = step(row(0, tau=0.5), row(1, tau=0.5, metric="entropy"))
    assert gate_taus(rows, ids, W, taus, solos, MASK, V) is None


def head(*seqs: Sequence, num_rows: int = 2, has_greedy_head: bool = True, has_gate: bool = True):
    rows, ids, taus, solos = step(*seqs, num_rows=num_rows)
    return choose_head(rows, ids, W, taus, solos, has_greedy_head=has_greedy_head, has_gate=has_gate,
                       mask_token_id=MASK, vocab_size=V)


def test_a_forward_asks_for_ids_where_every_row_reads_argmaxes_within_the_row_cap():
    assert GREEDY_HEAD_MAX_ROWS == 2 * W
    assert head(row(0, mode="ar"), row(1, mode="verify", drafts=[11])) == ("ids", None)
    assert head(row(0, mode="ar"), row(1, mode="ar"), has_greedy_head=False) == ("logits", None)
    assert head(row(0, mode="ar"), num_rows=3) == ("logits", None)  # 3 x 4 rows > GREEDY_HEAD_MAX_ROWS


def test_a_threshold_forward_goes_through_the_gate_where_every_row_may_skip_the_head():
    how, taus = head(row(0, tau=0.5), row(1, mode="ar"))
    assert how == "gate" and taus.dtype == np.float32 and taus.tolist() == [0.5, 1.0]
    assert head(row(0, tau=0.5), row(1, mode="ar"), has_gate=False) == ("logits", None)
    assert head(row(0, tau=0.5), row(1, tau=0.5, temperature=0.7)) == ("logits", None)
