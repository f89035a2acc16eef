"""Token selection for each prediction of a step: greedy, or sampled with temperature, top-k, top-p.

Dimension letters: M predictions one step offers a row, V vocabulary.

Meaning of tau under sampling (our choice; the paper decodes greedily and DESIGN.md §3
defines confidence on the model's prediction): every prediction j of a step is drawn from
its own filtered distribution (temperature, then top-k, then top-p), but the confidence
tested against tau is always that of the model's own distribution, the plain softmax of
the logits (for the probability metric: p(argmax)), whatever the temperature, top-k and
top-p. So the sampling settings never change which predictions pass tau: a small
temperature sharpens the distribution drawn from, and scoring that one would make every
mask look confident and accept junk. Prediction 0 is always accepted, so at tau >= 1 this
is exactly ordinary AR sampling. Below 1, mask predictions are drawn from their marginals
independently, an approximation of the joint the AR model would sample.

Temperatures below :data:`MIN_TEMPERATURE` (0 included) are greedy (:func:`is_greedy`, the
one place this rule lives): dividing float32 logits by such a temperature overflows them to
inf and the softmax to NaN (1e-38 gave token 0 forever), long after the distribution is
one-hot anyway.
"""

from __future__ import annotations

import numpy as np

from runtime.decode.acceptance import Confidences, softmax

MIN_TEMPERATURE = 1e-5  # below it, greedy (the same epsilon as vLLM's sampler)


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` decodes greedily (argmax): 0, or any value below :data:`MIN_TEMPERATURE`."""
    return temperature < MIN_TEMPERATURE


def select(logits: np.ndarray, temperature: float, top_k: int, top_p: float, metric: str,
           rng: np.random.Generator | None, with_confidence: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Pick one token per row, and the confidence of the model's prediction there.

    Args:
        logits: float32 [M, V].
        temperature: below :data:`MIN_TEMPERATURE` (0 included) greedy (argmax); else the
            token is drawn from the logits divided by it.
        top_k: keep the k most likely tokens (0 = all). top_p: keep the smallest set whose
            probability reaches top_p (1.0 = all). Both shape only the draw.
        metric: confidence metric (:data:`runtime.decode.acceptance.METRICS`) of the plain
            softmax of ``logits``: untempered and unfiltered (module docstring).
        rng: the request's generator; required unless greedy.
        with_confidence: False skips the softmax for the confidence (confidences are then 0).

    Returns:
        ids int64 [M], and the confidences [M]: :class:`~runtime.decode.acceptance.Confidences` (each row
        computed when the acceptance rule reads it), or float32 zeros without ``with_confidence``.

    Raises:
        ValueError: unknown metric.
    """
    confidences = Confidences(logits, metric)  # checks the metric before any work
    if is_greedy(temperature):
        ids = logits.argmax(axis=-1)
    else:
        ids = sample(filtered_probs(logits, temperature, top_k, top_p), rng)
    if not with_confidence:
        return ids, np.zeros(len(logits), np.float32)
    return ids, confidences


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Probabilities [M, V] after temperature, top-k and top-p (renormalized)."""
    with np.errstate(over="ignore"):  # the suppressed mask logit (float32 min) / temperature < 1 overflows to -inf: p = 0
        probs = softmax(logits / np.float32(temperature))
    if 0 < top_k < probs.shape[-1]:
        kth = np.partition(probs, -top_k, axis=-1)[:, -top_k, None]  # [M, 1]
        probs = np.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1)  # [M, V]
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of the strictly more likely tokens
        keep_sorted = before < top_p * sorted_probs.sum(axis=-1, keepdims=True)
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
    return (probs / probs.sum(axis=-1, keepdims=True)).astype(np.float32)


def sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row of probs [M, V] by inverse CDF; int64 [M]."""
    cdf = np.cumsum(probs, axis=-1)  # [M, V]
    draws = rng.random(len(probs)) * cdf[:, -1]  # [M]
    ids = (cdf <= draws[:, None]).sum(axis=-1)  # first index whose CDF passes the draw
    return np.minimum(ids, probs.shape[-1] - 1).astype(np.int64)
