"""MARS threshold decoding for one sequence, torch-free (MARS, arXiv 2604.07023, §3; DESIGN.md §3).

Dimension letters: W window, V vocabulary, P committed (cached) positions.

One decode step feeds the r committed tokens whose KV is not cached yet, followed by
W - r mask tokens, at consecutive positions P .. P+W-1 under a causal mask. The output at
the last real token is the greedy AR prediction; the output at the j-th mask predicts
the token j places later. So a step offers W - r + 1 predictions and accepts between 1
and min(B, W - r + 1) of them (:func:`runtime.acceptance.count_accepted`). Only the KV of
the r real tokens is committed.

Prefill puts every prompt token but the last into the cache, W at a time through the
same step graph; the last prompt token is the first step's pending token. So every
generated token comes from a decode step and TPF = tokens / decode forwards is exactly
1.0 at tau >= 1.

The mask token is never generated: its logit is set to the float32 minimum before the
argmax. (For a model whose argmax is never the mask token, tau >= 1 is exactly greedy AR.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from runtime.acceptance import METRICS, confidence, count_accepted
from runtime.bundle import BundleConfig
from runtime.kv_cache import KVCache


@dataclass(frozen=True)
class DecodeParams:
    """Per-request decoding parameters.

    Attributes:
        tau: confidence threshold, >= 0; >= 1 means greedy AR (one token per step).
        metric: confidence metric, one of ``probability``, ``margin``, ``entropy``.
        max_new_tokens: most tokens to generate, >= 1.
        block_size: most tokens accepted per step; None = the bundle's B.
        stop_ids: ids that end generation; None = the bundle's eos ids.

    Raises:
        ValueError: tau negative, NaN or infinite, unknown metric, max_new_tokens < 1, block_size < 1.
    """

    tau: float = 1.0
    metric: str = "probability"
    max_new_tokens: int = 128
    block_size: int | None = None
    stop_ids: frozenset[int] | None = None

    def __post_init__(self):
        if not isinstance(self.tau, (int, float)) or not math.isfinite(self.tau) or self.tau < 0:
            raise ValueError(f"tau must be a finite number >= 0, got {self.tau}; "
                             "tau >= 1 means one token per step (greedy AR)")
        if self.metric not in METRICS:
            raise ValueError(f"unknown confidence metric {self.metric!r}; choose one of {METRICS}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass
class GenerationResult:
    """Output of one generation.

    Attributes:
        token_ids: generated ids (prompt excluded), end token included if reached.
        num_forwards: decode forwards (prefill excluded).
        num_prefill_forwards: forwards spent on the prompt.
        seconds / prefill_seconds: wall-clock time of the whole call / of prefill.
        finish_reason: ``"stop"`` (end token) or ``"length"`` (max_new_tokens).
    """

    token_ids: list[int] = field(default_factory=list)
    num_forwards: int = 0
    num_prefill_forwards: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    finish_reason: str = "length"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tpf(self) -> float:
        """Tokens per decode forward."""
        return self.num_tokens / max(self.num_forwards, 1)

    def summary(self) -> dict:
        """The counts as a plain dict (for ``--json`` and benchmarks)."""
        decode_seconds = self.seconds - self.prefill_seconds
        return {"num_tokens": self.num_tokens, "num_forwards": self.num_forwards,
                "num_prefill_forwards": self.num_prefill_forwards, "tpf": self.tpf,
                "seconds": self.seconds, "prefill_seconds": self.prefill_seconds,
                "decode_tokens_per_second": self.num_tokens / decode_seconds if decode_seconds > 0 else None,
                "finish_reason": self.finish_reason}


def causal_window_mask(past_len: int, window: int) -> np.ndarray:
    """bool [1, 1, W, P + W]: query i sees the P cached keys and new keys 0..i."""
    keys = np.arange(past_len + window)
    queries = past_len + np.arange(window)
    return (keys[None, :] <= queries[:, None])[None, None]


def run_window(backend, cache: KVCache, tokens: list[int], fill_id: int, window: int) -> np.ndarray:
    """Feed ``tokens`` (1..W uncached real tokens) padded with ``fill_id`` to W; commit their KV.

    Returns:
        logits float32 [W, V] of this window.
    """
    assert 1 <= len(tokens) <= window
    ids = np.array([tokens + [fill_id] * (window - len(tokens))], dtype=np.int64)  # [1, W]
    positions = np.arange(cache.length, cache.length + window, dtype=np.int64)[None]  # [1, W]
    logits, presents = backend.step(ids, positions, causal_window_mask(cache.length, window), cache.past())
    cache.commit(presents, len(tokens))
    return logits[0]


class Decoder:
    """Prefill + MARS acceptance loop over a backend with :meth:`step` (onnxruntime or TensorRT).

    Args:
        backend: object with ``step(input_ids, position_ids, attention_mask, past)``
            as in :class:`runtime.onnx_backend.OnnxBackend`.
        config: the bundle config.
    """

    def __init__(self, backend, config: BundleConfig):
        self.backend = backend
        self.config = config

    def generate(self, prompt_ids: list[int], params: DecodeParams) -> GenerationResult:
        """Generate up to ``params.max_new_tokens`` tokens after ``prompt_ids``.

        Raises:
            ValueError: empty prompt, block_size above the bundle's B, or prompt plus
                max_new_tokens beyond the bundle's max context.
        """
        cfg, window = self.config, self.config.window
        block_size = self._check(prompt_ids, params)
        stop_ids = params.stop_ids if params.stop_ids is not None else frozenset(cfg.eos_token_ids)
        cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                        len(prompt_ids) + params.max_new_tokens + window, np.dtype(cfg.dtype))
        result, start = GenerationResult(), time.perf_counter()
        for chunk in range(0, len(prompt_ids) - 1, window):
            run_window(self.backend, cache, prompt_ids[chunk:min(chunk + window, len(prompt_ids) - 1)],
                       cfg.pad_token_id, window)
            result.num_prefill_forwards += 1
        result.prefill_seconds = time.perf_counter() - start
        pending = [prompt_ids[-1]]
        while result.finish_reason != "stop" and result.num_tokens < params.max_new_tokens:
            logits = run_window(self.backend, cache, pending, cfg.mask_token_id, window)[len(pending) - 1:]
            logits[:, cfg.mask_token_id] = np.finfo(np.float32).min  # the mask token is never generated
            pending = self._accept(logits, params, block_size, stop_ids, result)
            result.num_forwards += 1
        result.seconds = time.perf_counter() - start
        return result

    def _accept(self, logits: np.ndarray, params: DecodeParams, block_size: int,
                stop_ids: frozenset[int], result: GenerationResult) -> list[int]:
        """Accept from the [W - r + 1, V] predictions; append to ``result``; return new pending tokens."""
        predicted = logits.argmax(axis=-1)
        budget = min(block_size, params.max_new_tokens - result.num_tokens)
        scores = confidence(logits, params.metric) if params.tau < 1.0 else np.zeros(len(predicted))
        accepted = [int(t) for t in predicted[:count_accepted(predicted, scores, params.tau, budget, stop_ids)]]
        result.token_ids.extend(accepted)
        if accepted[-1] in stop_ids:
            result.finish_reason = "stop"
        return accepted

    def _check(self, prompt_ids: list[int], params: DecodeParams) -> int:
        cfg = self.config
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        block_size = params.block_size or cfg.block_size
        if block_size > cfg.block_size:
            raise ValueError(f"block_size {block_size} exceeds the bundle's block size {cfg.block_size}")
        needed = len(prompt_ids) + params.max_new_tokens + cfg.window
        if needed > cfg.max_context:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) + window "
                             f"({cfg.window}) = {needed} exceeds the model's max context {cfg.max_context}; "
                             "shorten the prompt or lower max_new_tokens")
        return block_size
