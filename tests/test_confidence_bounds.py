"""bench/confidence_bounds.py's bound on hand-made rows: ``p_lb <= p <= p_ub`` for the probability the runtime
computes from the full head's float32 logits (:func:`runtime.decode.acceptance.confidence`).

The model-level run is the smoke test ``test_scripts_smoke.py::test_confidence_bounds``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from support import load_script

from runtime.decode.acceptance import confidence

bounds = load_script(Path(__file__).resolve().parents[1] / "bench" / "confidence_bounds.py")
K, V, MASK, TOKEN = 32, 24, 5, 23
UNIT = 2.0 ** -24


def runtime_probability(logits: np.ndarray) -> float:
    """The probability metric of one row of float32 logits [V] as the engine computes it (mask token suppressed)."""
    logits = logits.astype(np.float32)
    logits[MASK] = np.finfo(np.float32).min
    return float(confidence(logits[None], "probability")[0])


def screening_row(logits: np.ndarray, screened: np.ndarray, error: np.ndarray, rescored: np.ndarray,
                  rounding: np.ndarray) -> tuple[float, float, float]:
    """(p, p_lb, p_ub) of one row: the runtime's p from ``logits`` and the script's bounds from the rest [V] each."""
    approx, error = screened.astype(np.float64), error.astype(np.float64)
    approx[MASK], error[MASK] = -np.inf, 0.0
    p_lb, p_ub = bounds.screening_bounds(approx[None], error[None], rescored[None].astype(np.float64),
                                         rounding[None].astype(np.float64))
    return runtime_probability(logits), float(p_lb[0]), float(p_ub[0])


def test_a_cancelling_row_whose_largest_logit_the_rescoring_misses():
    """The review's counterexample (tests/test_confidence_gate.py): x = (1e7, -1e7, 0.5, 0, ...) and token 23's
    column (1, 1, 1, 0, ...), every other column 0. The rescoring sums 1e7 + 0.5 - 1e7 in float32 and gets 0, the
    full head 1e7 - 1e7 + 0.5 and gets 0.5, within the rounding bound s_23 = 2 gamma_K |x|_1 (76): the rescored
    top (0, token 0) is not the largest logit, and a bound that takes it as one claimed p_ub 0.045 < p 0.0697."""
    big, half = np.float32(1e7), np.float32(0.5)
    logits = np.zeros(V, np.float32)
    logits[TOKEN] = (big - big) + half  # the full head's order
    rescored = np.zeros(V, np.float32)
    rescored[TOKEN] = (big + half) - big  # the rescoring's order: 0.5 lost
    assert (logits[TOKEN], rescored[TOKEN]) == (0.5, 0.0)
    error = np.full(V, 1e-3)  # the greedy head's e_v of a zero column: its absolute slack
    error[TOKEN] = 1e-3 * 2e7 + 1e-3  # its float-rounding allowance 1e-3 |x|_1 max|W_v|, enough for |0 - 0.5|
    rounding = np.zeros(V)
    rounding[TOKEN] = 2 * (K * UNIT / (1 - K * UNIT)) * (2e7 + 0.5)
    p, p_lb, p_ub = screening_row(logits, np.zeros(V), error, rescored, rounding)
    assert abs(p - 0.0697) < 1e-4
    assert p_lb <= p <= p_ub, (p_lb, p, p_ub)


def test_the_bounds_still_decide_a_row_without_cancellation():
    """Rescored logits equal to the full head's, small rounding bounds: p_lb and p_ub lie close around p, on a
    peaked row and a flat one (the fix may widen the bound, not give it up)."""
    rng = np.random.default_rng(0)
    for peak in (6.0, 0.5):
        logits = rng.standard_normal(V).astype(np.float32)
        logits[3] += peak
        error = np.full(V, 0.05)
        screened = logits + rng.uniform(-0.05, 0.05, V)
        p, p_lb, p_ub = screening_row(logits, screened, error, logits, np.full(V, 1e-5))
        assert 0.9 * p < p_lb <= p <= p_ub < 1.1 * p, (peak, p_lb, p, p_ub)
