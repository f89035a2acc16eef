"""The batched MARS decoding engine: schedule, run, accept, commit (MARS, arXiv 2604.07023, §3; DESIGN.md §3-4).

Dimension letters: n batch rows (= cache slots 0..n-1), W window, V vocabulary.

Every step is one forward of the step graph over the running rows:
  - a prefilling row feeds its next W prompt tokens (never the last one) and commits them;
    when the graph's window axis is dynamic, a prefilling row instead runs one forward of
    up to ``prefill_chunk`` prompt tokens alone per step, sits out the batch forward,
    and joins it once its prompt is cached;
  - a decoding row feeds its uncached real tokens, its drafts (verify mode), then mask
    tokens; the output at the last real token is the AR prediction, each later output
    predicts one more token ahead; the acceptance rule picks how many to keep. Verify-mode
    drafts come from the request's draft source (lookup and/or the last step's masks,
    :meth:`runtime.sequence.Sequence.prepare_drafts`); a ``lookup`` row feeds no masks.

Two batch schemes (DESIGN.md §4):
  - ``continuous``: each row commits the KV of its real tokens every step and advances on
    its own; a finished row's slot is refilled from the waiting queue at the next step.
  - ``block`` (the paper's block-level KV cache): a row's committed prefix is frozen for a
    block of W positions; each step re-runs the block (the anchor token, the tokens
    accepted so far in the block, then masks) until every row has a full block fed as W
    real tokens; then every row commits its W block entries at once. Fast rows wait for
    slow ones; new requests join only at a block boundary. Verify-mode rows always
    advance per row.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np

from runtime.acceptance import count_accepted, count_verified
from runtime.batch import run_batch, run_prefill
from runtime.bundle import BundleConfig
from runtime.kv_cache import KVCache
from runtime.params import DecodeParams, GenerationResult, check_tau
from runtime.sampling import select
from runtime.scheduler import Scheduler
from runtime.sequence import Sequence

SCHEMES = ("continuous", "block")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    Attributes:
        max_batch_size: KV slots, i.e. the most sequences decoding at once (>= 1).
        scheme: ``continuous`` or ``block`` (see the module docstring).
        max_seq_len: positions per slot (prompt + generated + W); None = the bundle's max context.
        prefill_chunk: prompt tokens per prefill forward when the backend's graph has a
            dynamic window axis (``backend.is_window_dynamic``); 0 prefills through the
            W-token step instead. Bounds the prefill's logits to ``prefill_chunk x V`` floats.

    Raises:
        ValueError: a value out of range.
    """

    max_batch_size: int = 8
    scheme: str = "continuous"
    max_seq_len: int | None = None
    prefill_chunk: int = 256

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown batch scheme {self.scheme!r}; choose one of {SCHEMES}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = prefill through the step window), got {self.prefill_chunk}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")


@dataclass
class StepOutput:
    """What one step did for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens accepted in this step (possibly none).
        finished: whether the request is done.
        finish_reason: ``stop``, ``length`` or ``abort`` once finished, else None.
        result: the request's tokens and counters so far.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    result: GenerationResult


class Engine:
    """Continuous-batching MARS decoder over a backend with ``step`` (onnxruntime or TensorRT).

    Not thread-safe: drive it from one thread.

    Args:
        backend: object with ``step(input_ids, position_ids, attention_mask, past)``,
            ``is_window_dynamic``, ``max_batch`` and ``max_past`` as
            :class:`runtime.onnx_backend.OnnxBackend`; no step feeds it a larger batch or past.
            A backend may offer ``make_cache`` (``KVCache``'s arguments) to hold the KV cache
            where it computes (:meth:`runtime.trt_backend.TrtBackend.make_cache`).
        config: the bundle config.
        engine_config: batch size, scheme and per-slot length.

    Raises:
        ValueError: ``max_batch_size`` or ``max_seq_len`` exceeds what a bounded backend
            (``max_batch`` not None: a TensorRT optimization profile) takes.
    """

    def __init__(self, backend, config: BundleConfig, engine_config: EngineConfig = EngineConfig()):
        self.backend, self.config, self.engine_config = backend, config, engine_config
        if backend.max_batch is not None and engine_config.max_batch_size > backend.max_batch:
            raise ValueError(f"max_batch_size {engine_config.max_batch_size} exceeds the backend's largest batch "
                             f"{backend.max_batch} (its optimization profile); lower it or rebuild the engine")
        if backend.max_batch is not None and (engine_config.max_seq_len or 0) > backend.max_past:
            raise ValueError(f"max_seq_len {engine_config.max_seq_len} exceeds the {backend.max_past} positions of "
                             "past the backend takes (its optimization profile); lower it or rebuild the engine")
        # The past fed is the whole cache capacity, so the capacity stays within the backend's max_past.
        max_len = min(engine_config.max_seq_len or config.max_context, config.max_context, backend.max_past)
        make_cache = getattr(backend, "make_cache", KVCache)  # a GPU backend keeps the cache in device memory
        self.cache = make_cache(config.num_layers, config.num_kv_heads, config.head_dim, max_len,
                                np.dtype(config.dtype), engine_config.max_batch_size)
        self.scheduler = Scheduler(engine_config.max_batch_size)
        self.is_window_dynamic = backend.is_window_dynamic  # T-token prefill, shorter AR steps
        self.prefill_chunk = engine_config.prefill_chunk if self.is_window_dynamic else 0
        self._default_tau = 1.0
        self.num_steps = 0  # batch forwards run so far

    @property
    def default_tau(self) -> float:
        """tau of requests whose ``params.tau`` is None, read at every step (the live knob)."""
        return self._default_tau

    @default_tau.setter
    def default_tau(self, tau: float) -> None:
        self._default_tau = check_tau(tau)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def add_request(self, prompt_ids: list[int], params: DecodeParams, request_id: str | None = None) -> str:
        """Queue a request; returns its id.

        Raises:
            ValueError: empty prompt, an id outside the vocabulary, block_size above the
                bundle's B, or prompt + max_new_tokens + W beyond the per-slot length
                (``cache.max_len``).
        """
        cfg = self.config
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
        block_size = params.block_size or cfg.block_size
        if block_size > cfg.block_size:
            raise ValueError(f"block_size {block_size} exceeds the bundle's block size {cfg.block_size}")
        needed = len(prompt_ids) + params.max_new_tokens + cfg.window
        if needed > self.cache.max_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) + window "
                             f"({cfg.window}) = {needed} exceeds the {self.cache.max_len} positions a slot can hold "
                             "(the model's max context, the backend's largest past, max_seq_len); "
                             "shorten the prompt or lower max_new_tokens")
        stop_ids = params.stop_ids if params.stop_ids is not None else frozenset(cfg.eos_token_ids)
        request_id = request_id or uuid.uuid4().hex
        self.scheduler.add(Sequence(request_id, list(prompt_ids), params, block_size, stop_ids))
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a request now and free its slot; unknown or finished ids are ignored."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return
        if seq.slot is None:
            self.scheduler.remove_waiting(seq)
        else:
            self._finish(seq, "abort")

    def step(self) -> list[StepOutput]:
        """Admit waiting requests, run one forward over the running rows, accept and commit."""
        can_admit = self.engine_config.scheme == "continuous" or all(
            len(s.uncached) == 1 for s in self.scheduler.running.values())
        running = self.scheduler.schedule(can_admit)
        if not running:
            return []
        for seq in running:
            seq.start_time = seq.start_time or time.perf_counter()
            if self.prefill_chunk and seq.is_prefilling:
                self._prefill_chunk(seq)
        if self.prefill_chunk:  # rows still prefilling sit out the batch forward (idle rows)
            running = [s for s in running if not s.is_prefilling]
            if not running:
                return []
        for seq in running:
            if seq.params.mode == "verify" and not seq.is_prefilling:
                seq.prepare_drafts()
        window = self._step_window(running)
        rows: list[list[int] | None] = [None] * self.scheduler.num_rows
        for seq in running:
            rows[seq.slot] = self._prepare_row(seq, window)
        self.cache.reserve(max(int(self.cache.lengths[s.slot]) + window for s in running))
        logits, presents = run_batch(self.backend, self.cache, rows, self.config.pad_token_id)  # [n, W, V]
        logits[:, :, self.config.mask_token_id] = np.finfo(np.float32).min  # the mask token is never generated
        self.num_steps += 1
        counts = np.zeros(len(rows), np.int64)  # [n] KV entries to commit per row
        advanced = [(seq, out) for seq in running if (out := self._advance(seq, logits[seq.slot], counts))]
        if self.engine_config.scheme == "block":
            self._close_block(running, counts)
        self.cache.commit(presents, counts)
        for seq, out in advanced:
            if out.finished:
                self._finish(seq, out.finish_reason)
        return [out for _, out in advanced]

    def generate(self, prompts: list[list[int]], params: DecodeParams) -> list[GenerationResult]:
        """Run ``prompts`` to completion with the same params; results in prompt order.

        Raises:
            ValueError: as :meth:`add_request`.
        """
        ids = [self.add_request(p, params) for p in prompts]
        results = {}
        while len(results) < len(ids):
            results.update((o.request_id, o.result) for o in self.step() if o.finished)
        return [results[i] for i in ids]

    def _prefill_chunk(self, seq: Sequence) -> None:
        """Commit the next up to ``prefill_chunk`` prompt tokens (never the last) in one forward.

        One chunk per step, so a long prompt delays the other rows' tokens by one chunk's
        forward per step rather than by its whole prefill.
        """
        chunk = seq.prefill_chunk(self.prefill_chunk)
        self.cache.reserve(int(self.cache.lengths[seq.slot]) + len(chunk))
        self.cache.commit_slot(seq.slot, run_prefill(self.backend, self.cache, seq.slot, chunk))
        self._count_prefilled(seq, len(chunk))

    @staticmethod
    def _count_prefilled(seq: Sequence, num_tokens: int) -> None:
        """Record one prefill forward of ``num_tokens`` prompt tokens, and the prefill time once done."""
        seq.num_prefilled += int(num_tokens)
        seq.result.num_prefill_forwards += 1
        if not seq.is_prefilling:
            seq.result.prefill_seconds = time.perf_counter() - seq.start_time

    def _step_window(self, running: list[Sequence]) -> int:
        """Tokens per row in this step: W, or (continuous scheme, dynamic window) the widest
        :meth:`_row_width` of the batch, capped at W."""
        can_shrink = self.engine_config.scheme == "continuous" and self.is_window_dynamic
        if not can_shrink or any(s.is_prefilling for s in running):
            return self.config.window
        return min(max(self._row_width(s) for s in running), self.config.window)

    def _row_width(self, seq: Sequence) -> int:
        """Inputs a row can use: its uncached real tokens, then (threshold at tau < 1 and verify
        mode) one draft or mask per further token it may accept; AR rows need no mask, and
        verify rows drafting by lookup alone feed only their drafts (none: one token, as AR)."""
        if seq.params.mode == "verify" and seq.params.draft == "lookup":
            return len(seq.uncached) + len(seq.drafts)
        uses_masks = seq.params.mode == "verify" or self._tau(seq) < 1.0
        return len(seq.uncached) + (seq.block_size - 1 if uses_masks else 0)

    def _tau(self, seq: Sequence) -> float:
        """The threshold this row uses now: 1 in ar mode, else its own or the live default."""
        params = seq.params
        return 1.0 if params.mode == "ar" else self.default_tau if params.tau is None else params.tau

    def _prepare_row(self, seq: Sequence, window: int) -> list[int]:
        """The ``window`` ids row ``seq`` feeds: a prefill chunk, or uncached + drafts + masks."""
        if seq.is_prefilling:
            chunk = seq.prefill_chunk(window)
            return chunk + [self.config.pad_token_id] * (window - len(chunk))
        real = seq.uncached[:window] + seq.drafts[:window - min(len(seq.uncached), window)]
        return real + [self.config.mask_token_id] * (window - len(real))

    def _advance(self, seq: Sequence, logits: np.ndarray, counts: np.ndarray) -> StepOutput | None:
        """Accept from this row's logits [w, V] (w: this step's window); set its commit count;
        return its output (None in prefill)."""
        if seq.is_prefilling:
            counts[seq.slot] = len(seq.prefill_chunk(self.config.window))
            self._count_prefilled(seq, counts[seq.slot])
            return None
        num_real = min(len(seq.uncached), len(logits))
        predictions = logits[num_real - 1:]  # [w - r + 1, V]: the AR prediction, then one per later input
        if seq.params.mode == "verify":
            tokens = self._accept_verify(seq, predictions, num_real, counts)
        else:
            tokens = self._accept_threshold(seq, predictions, num_real, counts)
        seq.add_tokens(tokens)
        seq.result.num_forwards += 1
        reason = "stop" if tokens and tokens[-1] in seq.stop_ids else "length" if seq.num_remaining == 0 else None
        return StepOutput(seq.request_id, tokens, reason is not None, reason, seq.result)

    def _accept_threshold(self, seq: Sequence, predictions: np.ndarray, num_real: int, counts: np.ndarray) -> list[int]:
        """MARS §3: keep predictions left to right while confident (threshold and ar modes)."""
        params, window, tau = seq.params, self.config.window, self._tau(seq)
        budget = min(seq.block_size, seq.num_remaining)
        if self.engine_config.scheme == "block":
            budget = min(budget, window + 1 - len(seq.uncached))  # a block yields at most W tokens
            seq.is_block_ready = num_real == window
        else:
            counts[seq.slot] = num_real
        if budget == 0:  # block scheme: a full block re-run until every row is ready
            return []
        ids, scores = select(predictions, params.temperature, params.top_k, params.top_p, params.metric,
                             seq.rng, with_confidence=tau < 1.0)
        tokens = [int(t) for t in ids[:count_accepted(ids, scores, tau, budget, seq.stop_ids)]]
        seq.uncached = seq.uncached + tokens if self.engine_config.scheme == "block" else tokens
        return tokens

    def _accept_verify(self, seq: Sequence, predictions: np.ndarray, num_real: int, counts: np.ndarray) -> list[int]:
        """DESIGN.md §3 verify mode: keep drafts equal to the argmax before them; exactly greedy AR."""
        predicted = predictions.argmax(axis=-1)  # [w - r + 1]
        drafts = seq.drafts[:len(predicted) - 1]  # the drafts this step fed
        count = count_verified(drafts, predicted, min(seq.block_size, seq.num_remaining), seq.stop_ids)
        tokens = [int(t) for t in predicted[:count]]
        counts[seq.slot] = num_real + count - 1  # the real tokens and the kept drafts
        is_all_kept = count - 1 == len(drafts) and tokens[-1] not in seq.stop_ids
        seq.mask_drafts = [int(t) for t in predicted[len(drafts) + 1:][:seq.block_size - 1]] if is_all_kept else []
        seq.uncached = [tokens[-1]]
        return tokens

    def _close_block(self, running: list[Sequence], counts: np.ndarray) -> None:
        """Block scheme: once every threshold-mode decoding row is ready, commit each row's W block entries."""
        window = self.config.window
        in_block = [s for s in running if not s.is_prefilling and s.params.mode != "verify"
                    and not self._is_done(s)]
        if not in_block or not all(s.is_block_ready for s in in_block):
            return
        for seq in in_block:
            counts[seq.slot] = window
            seq.uncached = seq.uncached[window:]
            seq.is_block_ready = False

    def _is_done(self, seq: Sequence) -> bool:
        tokens = seq.result.token_ids
        return seq.num_remaining == 0 or bool(tokens) and tokens[-1] in seq.stop_ids

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.result.finish_reason = reason
        seq.result.seconds = time.perf_counter() - seq.start_time if seq.start_time else 0.0
        self.cache.free(seq.slot)
        self.scheduler.finish(seq)
