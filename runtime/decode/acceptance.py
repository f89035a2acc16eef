"""The MARS acceptance rule (MARS, arXiv 2604.07023, §3 "inference"; DESIGN.md §3).

Plain functions over numpy arrays, testable without a model. Dimension letters:
T = predictions available in one step, V = vocabulary.

Rule, left to right: prediction 0 (the output at the last real token, i.e. the greedy AR
token) is always accepted. Prediction j >= 1 (the output at the j-th mask) is accepted while
  - every earlier accepted token is not an end token,
  - fewer than ``max_accept`` tokens have been accepted, and
  - its confidence is strictly greater than ``tau``.
With tau >= 1 no confidence passes, so exactly one token per step: greedy AR.
"""

from __future__ import annotations

import numpy as np

METRICS = ("probability", "margin", "entropy")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float32 in and out; [T, V] -> [T, V]."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def confidence(logits: np.ndarray, metric: str = "probability") -> np.ndarray:
    """Confidence of the argmax of each row of logits, in [0, 1]; [T, V] float32 -> [T] float32.

    Raises:
        ValueError: unknown metric.
    """
    return probability_confidence(softmax(logits.astype(np.float32, copy=False)), metric)


def probability_confidence(probs: np.ndarray, metric: str = "probability") -> np.ndarray:
    """Confidence of the most likely token of each row of probabilities; [T, V] -> [T] float32.

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
        top2 = np.partition(probs, -2, axis=-1)[:, -2:]  # [T, 2], unordered
        return np.abs(top2[:, 1] - top2[:, 0])
    if metric == "entropy":
        entropy = -(probs * np.log(np.maximum(probs, 1e-30))).sum(axis=-1)
        return 1.0 - entropy / np.log(probs.shape[-1])
    raise ValueError(f"unknown confidence metric {metric!r}; choose one of {METRICS}")


def count_accepted(predicted_ids: np.ndarray, confidences: np.ndarray, tau: float,
                   max_accept: int, stop_ids: frozenset[int]) -> int:
    """How many of the T predictions of one step to accept, left to right.

    Args:
        predicted_ids: [T] int, argmax ids; index 0 is the AR prediction.
        confidences: [T] float, from :func:`confidence`.
        tau: threshold; >= 1 means one token per step.
        max_accept: upper bound on the count (block size, remaining budget), >= 1.
        stop_ids: end-token ids; nothing is accepted after one of them.

    Returns:
        The count n, 1 <= n <= min(T, max_accept).
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
