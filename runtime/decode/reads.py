"""How a step reads its outputs: which positions of a row's window are read, and what the forward asks the
backend for (DESIGN.md §3; the engine's :meth:`runtime.decode.engine.Engine.step` applies it). Pure: no model.

A decoding row's window is its r real (uncached) tokens, its k drafts, then masks; the acceptance rule reads the
output at the last real token (the AR prediction), one per draft, and the masks up to the row's solo width (the
width its step would have alone, :meth:`runtime.decode.scheduler.Scheduler.solo_width`); a wider batch's extra
masks are never read. What a forward returns (the engine's ``reads``):

- ``"ids"``: each position's argmax id [n, w], the float32 output head skipped (the greedy head), where the backend
  has the head, the forward has at most ``GREEDY_HEAD_MAX_ROWS`` rows n·w and every row reads argmaxes only
  (:func:`reads_ids_only`);
- ``"proven"``: the same ids, from a threshold step whose confidence gate skipped the head (:func:`gate_taus`):
  every row's first confidence read is proven not above its tau;
- ``"logits"``: the logits [n, w, V].

:func:`choose_head` picks ``"ids"``, ``"gate"`` (the gate then answers ``"proven"`` or ``"logits"``) or
``"logits"`` before the forward.
"""

from __future__ import annotations

import numpy as np

from runtime.bundle import GREEDY_HEAD_MAX_ROWS
from runtime.decode.sampling import is_greedy
from runtime.decode.sequence import Sequence


def read_inputs(seq: Sequence, width: int, solo_width: int) -> tuple[int, int, int]:
    """(r, k, end) of the decoding row ``seq`` in a step of width ``width``, as the engine slices its predictions:
    its r real inputs, then k drafts, read up to input ``end`` (its solo width ``solo_width``, capped at
    ``width``); the inputs from r + k to ``end`` are masks it reads."""
    num_real = min(len(seq.uncached), width)
    end = min(solo_width, width)
    return num_real, min(len(seq.drafts), end - num_real), end


def first_read_position(seq: Sequence, width: int, solo_width: int) -> int | None:
    """The window position (0..w-1) whose output's confidence the acceptance rule reads first in this step of the
    decoding row ``seq`` (as :func:`runtime.decode.acceptance.accept` reads them: the output after its real tokens
    and drafts), or None where it reads none (no mask is read)."""
    num_real, num_drafts, end = read_inputs(seq, width, solo_width)
    position = num_real + num_drafts
    return position if position < end else None


def reads_ids_only(seq: Sequence, width: int, tau: float, solo_width: int) -> bool:
    """Whether the row's step (of width ``width``, the row at threshold ``tau``) reads no more than each
    prediction's argmax: a prefill chunk, or greedy decoding that tests no confidence: tau >= 1 (as
    ``select(with_confidence=tau < 1)``), or a step that feeds the row no mask it reads (adaptive masks backing
    off, a block size of 1)."""
    if seq.is_prefilling:
        return True
    return is_greedy(seq.params.temperature) and (tau >= 1.0 or first_read_position(seq, width, solo_width) is None)


def gate_tau(seq: Sequence, row_ids: list[int], width: int, tau: float, solo_width: int, mask_token_id: int,
             vocab_size: int) -> np.float32 | None:
    """The confidence gate's ``confidence_tau`` of one row fed ``row_ids`` (mars_export.confidence_gate), or None
    where the step must read the row's logits: it samples, tests another metric, tests a tau below 1 / V (every
    probability passes it), or its first confidence read is not at its window's first mask token (a draft equal to
    the mask token). A row reading no confidence gets 1 (never tested); the others their tau as a float32 at most
    tau (rounded down where float32 rounds it up), so the gate's ``p_ub <= tau32`` fails the rule's ``p > tau``
    however numpy compares a float32 with a Python float."""
    if reads_ids_only(seq, width, tau, solo_width):
        return np.float32(1)
    if not is_greedy(seq.params.temperature) or seq.params.metric != "probability":
        return None
    position = first_read_position(seq, width, solo_width)  # not None: a greedy row not reading ids only
    if mask_token_id not in row_ids or row_ids.index(mask_token_id) != position:
        return None
    if tau * vocab_size < 1:
        return None
    tau32 = np.float32(tau)
    return np.nextafter(tau32, np.float32(-np.inf)) if float(tau32) > float(tau) else tau32


def gate_taus(rows: list[Sequence], row_ids: list[list[int] | None], width: int, taus: list[float],
              solo_widths: list[int], mask_token_id: int, vocab_size: int) -> np.ndarray | None:
    """The confidence gate's ``confidence_tau`` float32 [n] for a step (n = ``len(row_ids)``, indexed by slot), or
    None where some row's logits are read (:func:`gate_tau`). ``taus`` and ``solo_widths`` go with ``rows``; an idle
    slot gets 1 (never tested)."""
    out = np.ones(len(row_ids), np.float32)
    for seq, tau, solo_width in zip(rows, taus, solo_widths):
        row_tau = gate_tau(seq, row_ids[seq.slot], width, tau, solo_width, mask_token_id, vocab_size)
        if row_tau is None:
            return None
        out[seq.slot] = row_tau
    return out


def choose_head(rows: list[Sequence], row_ids: list[list[int] | None], width: int, taus: list[float],
                solo_widths: list[int], *, has_greedy_head: bool, has_gate: bool, mask_token_id: int,
                vocab_size: int) -> tuple[str, np.ndarray | None]:
    """What a forward of ``rows`` (fed ``row_ids`` [n][w] by slot; ``taus``, ``solo_widths`` go with ``rows``) asks
    the backend for: ``("ids", None)``, ``("gate", confidence_tau)`` or ``("logits", None)`` (module docstring).

    Args:
        has_greedy_head: the backend takes ``num_greedy`` (``takes_num_greedy``).
        has_gate: the backend takes ``confidence_tau`` (``takes_confidence_gate``).
    """
    if not has_greedy_head or len(row_ids) * width > GREEDY_HEAD_MAX_ROWS:
        return "logits", None
    if all(reads_ids_only(seq, width, tau, solo) for seq, tau, solo in zip(rows, taus, solo_widths)):
        return "ids", None
    confidence_tau = gate_taus(rows, row_ids, width, taus, solo_widths, mask_token_id, vocab_size) if has_gate else None
    return ("logits", None) if confidence_tau is None else ("gate", confidence_tau)
