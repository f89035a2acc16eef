"""The MARS acceptance rule (MARS, arXiv 2604.07023, §3 "inference"; DESIGN.md §3).

Plain functions over numpy arrays, testable without a model. Dimension letters:
M = predictions one step offers a row (see :mod:`runtime`), V = vocabulary.

Rule, left to right: prediction 0 (the output at the last real token, i.e. the greedy AR
token) is always accepted. Prediction j >= 1 (the output at the j-th mask) is accepted while
  - every earlier accepted token is not an end token,
  - fewer than ``max_accept`` tokens have been accepted, and
  - its confidence is strictly greater than ``tau``.
With tau >= 1 no confidence passes, so exactly one token per step: greedy AR.

With drafts fed after the real tokens (DESIGN.md §3 "Draft sources"), the drafts are checked
first: draft i + 1 is kept while it equals prediction i (:func:`count_verified`); once all are
kept, the prediction at the last draft is the exact next token and the rule above goes on
from there over the masks (in verify mode, tau is 1: the exact token only).

:func:`accept` is that rule as a pure function of one row's predictions: it returns the
tokens the step yields and how many of the row's KV entries to commit (:class:`Accepted`);
the engine applies them in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("probability", "margin", "entropy")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float32 in and out; [M, V] -> [M, V]."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def confidence(logits: np.ndarray, metric: str = "probability") -> np.ndarray:
    """Confidence of the argmax of each row of logits, in [0, 1]; [M, V] float32 -> [M] float32.

    The probability metric skips the normalized softmax: p(argmax) = exp(0) / sum(exp(logits - max)) is
    ``1 / sum``, the same float32 division (bit-identical to :func:`probability_confidence` of the softmax).

    Raises:
        ValueError: unknown metric.
    """
    logits = logits.astype(np.float32, copy=False)
    if metric == "probability":
        total = np.exp(logits - logits.max(axis=-1, keepdims=True)).sum(axis=-1)  # [M]
        return np.float32(1.0) / total
    return probability_confidence(softmax(logits), metric)


class Confidences:
    """The confidences (:func:`confidence`) of one step's prediction rows, each computed when first read.

    The acceptance rule reads them left to right and stops at the first row not above tau, and it
    never reads row 0 (the exact next token is accepted whatever its confidence), so most rows of a
    wide window are never computed; a softmax over the vocabulary per row was the runtime's largest
    own cost per step in threshold mode. Reads like a float32 sequence: ``c[j]`` (an ``np.float32``, so
    ``c[j] > tau`` compares in float32 as the eager array did, and as the C sample copies), ``len(c)``,
    ``c[a:b]`` (the rows a..b-1, computed when read), ``np.asarray(c)`` (all rows, float32 [M]).

    Args:
        logits: float32 [M, V]: the rows' logits (kept, not copied).
        metric: one of :data:`METRICS`.

    Raises:
        ValueError: unknown metric.
    """

    def __init__(self, logits: np.ndarray, metric: str = "probability"):
        if metric not in METRICS:
            raise ValueError(f"unknown confidence metric {metric!r}; choose one of {METRICS}")
        self.logits, self.metric = logits, metric
        self._rows: dict[int, np.float32] = {}  # row -> its confidence, once read

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Confidences(self.logits[index], self.metric)
        row = range(len(self.logits))[index]  # IndexError past the end, as a sequence's
        if row not in self._rows:
            self._rows[row] = confidence(self.logits[row:row + 1], self.metric)[0]  # np.float32: compared with tau
        return self._rows[row]                                                       # as the eager array's were

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.array([self[row] for row in range(len(self))], dtype or np.float32)


class ProvenRejection:
    """The confidences of a step whose float32 output head the confidence gate skipped
    (mars_export.confidence_gate): row ``row`` is proven not above tau; no other row is known.

    Reads as :class:`Confidences` does (``c[j]``, ``len(c)``, ``c[a:b]``): ``c[row]`` is -inf, and reading any
    other row raises, so a caller that would read past the proven rejection fails loudly instead of
    deciding on a number nobody computed.

    Args:
        length: M, the step's prediction rows; row: the row proven not above tau (a slice that leaves it out
            knows no row).

    Raises:
        LookupError: on reading a row other than ``row``.
    """

    def __init__(self, length: int, row: int):
        self.length, self.row = length, row

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, _ = index.indices(self.length)
            return ProvenRejection(max(stop - start, 0), self.row - start)
        row = range(self.length)[index]
        if row != self.row:
            raise LookupError(f"confidence row {row} was not computed (the gate skipped the output head; only row "
                              f"{self.row} is known: not above tau)")
        return np.float32(-np.inf)


def probability_confidence(probs: np.ndarray, metric: str = "probability") -> np.ndarray:
    """Confidence of the most likely token of each row of probabilities; [M, V] -> [M] float32.

    Metrics:
        probability: p(argmax) (the paper's rule; default).
        margin: p(top1) - p(top2).
        entropy: 1 - H(p) / ln(V), so "entropy below a bound" reads as "confidence above tau".

    Raises:
        ValueError: unknown metric.
    """
    if metric == "probability":
        return probs.max(axis=-1)
    if metric == "margin":
        top2 = np.partition(probs, -2, axis=-1)[:, -2:]  # [M, 2], unordered
        return np.abs(top2[:, 1] - top2[:, 0])
    if metric == "entropy":
        entropy = -(probs * np.log(np.maximum(probs, 1e-30))).sum(axis=-1)
        return (1.0 - entropy / np.log(probs.shape[-1])).astype(np.float32)
    raise ValueError(f"unknown confidence metric {metric!r}; choose one of {METRICS}")


def count_accepted(predicted_ids: np.ndarray, confidences: np.ndarray, tau: float,
                   max_accept: int, stop_ids: frozenset[int]) -> int:
    """How many of the M predictions of one step to accept, left to right.

    Args:
        predicted_ids: [M] int, argmax ids; index 0 is the AR prediction.
        confidences: [M] float, from :func:`confidence` (an array, or :class:`Confidences`: row j is read
            only when rows 1..j-1 passed; row 0 never).
        tau: threshold; >= 1 means one token per step.
        max_accept: upper bound on the count (block size, remaining budget), >= 1.
        stop_ids: end-token ids; nothing is accepted after one of them.

    Returns:
        The count n, 1 <= n <= min(M, max_accept).
    """
    assert max_accept >= 1 and len(predicted_ids) >= 1
    limit = min(len(predicted_ids), max_accept)
    count = 1
    while (count < limit and int(predicted_ids[count - 1]) not in stop_ids
           and confidences[count] > tau):
        count += 1
    return count


def count_verified(drafts: list[int], predicted_ids: np.ndarray, max_accept: int, stop_ids: frozenset[int]) -> int:
    """Verify mode (DESIGN.md §3): how many tokens one step yields from k drafts, left to right.

    ``predicted_ids[i]`` is the argmax at the input before draft i+1 (index 0: at the last
    real token). Draft i+1 is kept while it equals ``predicted_ids[i]``; the tokens yielded
    are ``predicted_ids[:n]``, i.e. the kept drafts and then the argmax after the last kept
    one (the correction, or the next token). So the output is exactly greedy AR.

    Args:
        drafts: the k draft ids fed after the real tokens.
        predicted_ids: [>= k + 1] int argmax ids.
        max_accept: upper bound on n (block size, remaining budget), >= 1.
        stop_ids: end-token ids; nothing is yielded after one of them.

    Returns:
        n, 1 <= n <= min(k + 1, max_accept); the n - 1 kept drafts are real tokens whose KV is valid.
    """
    assert max_accept >= 1 and len(predicted_ids) > len(drafts)
    count = 1
    while (count < max_accept and count <= len(drafts) and int(predicted_ids[count - 1]) not in stop_ids
           and drafts[count - 1] == int(predicted_ids[count - 1])):
        count += 1
    return count


def max_accept(block_size: int, num_remaining: int, num_uncached: int, window: int, is_block: bool) -> int:
    """The budget of one step: at most B tokens and the tokens left; in the block scheme also
    W + 1 - (the block's uncached tokens), so a block yields at most W tokens. 0: a block-scheme
    row whose block is full waits (its step yields nothing)."""
    budget = min(block_size, num_remaining)
    return min(budget, window + 1 - num_uncached) if is_block else budget


@dataclass(frozen=True)
class Accepted:
    """What one step yields for one row (returned by the acceptance rules, applied by the engine).

    Attributes:
        tokens: the tokens accepted, in order (possibly none: a block-scheme row waiting for
            the block to close, or a prefill row).
        num_committed: how many of the row's fed inputs get their KV committed, from the first
            (the uncached real tokens, then kept verify drafts); block scheme: 0 until the block closes.
        mask_drafts: verify mode: the predictions at the masks after the last token yielded,
            the next step's drafts (empty unless every draft was kept).
    """

    tokens: list[int]
    num_committed: int
    mask_drafts: list[int] = field(default_factory=list)


def accept(predicted_ids: np.ndarray, confidences: np.ndarray, tau: float, drafts: list[int], max_accept: int,
           stop_ids: frozenset[int], num_real: int, block_size: int, is_block: bool) -> Accepted:
    """One row's step: keep the drafts equal to the prediction before them, then (all kept)
    accept the predictions from the exact next token on while confident (MARS §3; DESIGN.md §3).

    Args:
        predicted_ids: [M] int chosen ids (index 0 at the last real token; argmax when drafts are fed).
        confidences: [M] float, as :func:`count_accepted`.
        tau: threshold; >= 1 (ar and verify mode) keeps the exact next token only.
        drafts: the k draft ids this step fed after the real tokens (k < M; none in plain threshold mode).
        max_accept, stop_ids: as :func:`count_accepted`.
        num_real: r, the uncached real tokens fed before the drafts.
        block_size: B, the most mask predictions kept as the next step's drafts + 1.
        is_block: a block-scheme row (nothing is committed until its block closes).

    Returns:
        :class:`Accepted`: tokens ``predicted_ids[:n]``, 1 <= n <= min(M, max_accept); r + the
        kept drafts committed (0 in an open block); when every draft was kept and no end token
        came, the next predictions (at most B - 1) as the next step's mask drafts.
    """
    kept = count_verified(drafts, predicted_ids, max_accept, stop_ids) - 1
    count = kept + 1
    if kept == len(drafts):  # the prediction at the last draft is the exact next token
        count = kept + count_accepted(predicted_ids[kept:], confidences[kept:], tau, max_accept - kept, stop_ids)
    tokens = [int(t) for t in predicted_ids[:count]]
    is_all_kept = kept == len(drafts) and tokens[-1] not in stop_ids
    mask_drafts = [int(t) for t in predicted_ids[count:][:block_size - 1]] if is_all_kept else []
    return Accepted(tokens, 0 if is_block else num_real + kept, mask_drafts)
