"""The batched MARS decoding engine: schedule, run, accept, commit (MARS, arXiv 2604.07023, §3; DESIGN.md §3-4).

Dimension letters (glossary in :mod:`runtime`): n batch rows (= cache slots 0..n-1), W window,
w this step's window, M predictions of a row, V vocabulary.

:meth:`Engine.step` reads schedule, run, accept, commit: the scheduler's plan
(:class:`runtime.decode.scheduler.StepPlan`) says who feeds what and how wide; one forward
runs it, asking for argmax ids, the confidence gate or logits as :mod:`runtime.decode.reads` says;
the pure acceptance rules (:mod:`runtime.decode.acceptance`) say what each row keeps and how
many KV entries it commits; :meth:`Engine._commit` is the one place that changes the sequences
and the cache. A row's ``uncached`` tokens are always the real tokens
whose KV is not committed: commit appends the accepted tokens and drops the committed ones.

Every step is one forward of the step graph over the running rows:
  - a prefilling row feeds its next W prompt tokens (never the last one) and commits them;
    when the graph's window axis is dynamic, a prefilling row instead runs one forward of
    up to ``prefill_chunk`` prompt tokens per step (alone, or with other rows' first chunks
    of near length: batched prefill), sits out the batch forward, and joins it once its
    prompt is cached;
  - a decoding row feeds its uncached real tokens, its drafts, then mask tokens; the output
    at the last real token is the AR prediction, each later output predicts one more token
    ahead; the acceptance rule picks how many to keep. Drafts (verify mode, or threshold
    mode with draft ``lookup``/``both``) come from the request's draft source (lookup and/or
    the last step's masks, :meth:`runtime.decode.sequence.Sequence.prepare_drafts`); a row
    that needs no mask (verify with ``lookup``, threshold at tau >= 1) feeds none.

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

from runtime.bundle import BundleConfig
from runtime.decode.acceptance import Accepted, ProvenRejection, accept, max_accept
from runtime.decode.admission import (SettingError, check_max_batch_size, check_max_seq_len, check_prompt_ids,
                                      why_no_adaptive_masks)
from runtime.decode.batch import run_batch, run_first_chunks, run_prefill
from runtime.decode.kv_cache import KVCache
from runtime.decode.mask_backoff import tokens_from_masks
from runtime.decode.params import DecodeParams, GenerationResult, ParamError, check_tau
from runtime.decode.reads import choose_head, first_read_position, read_inputs
from runtime.decode.sampling import select
from runtime.decode.scheduler import SCHEMES, Scheduler, StepPlan
from runtime.decode.sequence import Sequence


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    Attributes:
        max_batch_size: KV slots, i.e. the most sequences decoding at once (>= 1).
        scheme: ``continuous`` or ``block`` (see the module docstring).
        max_seq_len: positions per slot (prompt + generated + W); None = the bundle's max context. At least
            2 here; the engine refuses fewer than W + 2 (:func:`runtime.decode.admission.min_seq_len`).
        prefill_chunk: prompt tokens per prefill forward when the backend's graph has a
            dynamic window axis (``backend.is_window_dynamic``); 0 prefills through the
            W-token step instead. Graphs without the ``num_logits`` input (exports before 2026-12-02)
            also compute the chunk's logits, ``prefill_chunk x V`` floats.

    Raises:
        SettingError: a value out of range (``setting`` names it).
    """

    max_batch_size: int = 8
    scheme: str = "continuous"
    max_seq_len: int | None = None
    prefill_chunk: int = 256

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise SettingError("max_batch_size", f"must be >= 1, got {self.max_batch_size}")
        if self.scheme not in SCHEMES:
            raise SettingError("scheme", f"{self.scheme!r} is not a batch scheme; choose one of {SCHEMES}")
        if self.prefill_chunk < 0:
            raise SettingError("prefill_chunk", f"must be >= 0 (0 = prefill through the step window), got "
                                                f"{self.prefill_chunk}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise SettingError("max_seq_len", f"must be >= 2, got {self.max_seq_len}")


class CannotGrowCache(MemoryError):
    """The KV cache could not grow for some rows: its larger buffers (every slot at the new capacity) cannot be
    allocated. The engine has finished those rows (their slots are free; their requests get no more outputs) and
    left the others as they were: they go on at the next step, within the capacity the cache holds.

    Attributes:
        request_ids: the rows' requests, which needed more positions than the cache holds.
        capacity: positions per slot the cache holds (and keeps).
        needed: positions per slot the step needed.
        num_slots: N, the cache's slots (each holds ``capacity`` positions, in use or not).
    """

    def __init__(self, request_ids: list[str], capacity: int, needed: int, num_slots: int, cause: MemoryError):
        super().__init__(f"the KV cache cannot grow from {capacity} to {needed} positions for each of its {num_slots} "
                         f"slots: {cause}")
        self.request_ids, self.capacity, self.needed, self.num_slots = request_ids, capacity, needed, num_slots


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
            :class:`runtime.backends.onnx.OnnxBackend`; no step feeds it a larger batch or past.
            A backend with a dynamic window also takes ``step(..., logits=False)`` (prefill
            forwards, whose logits are not read).
            A backend may offer ``make_cache`` (``KVCache``'s arguments) to hold the KV cache
            where it computes (:meth:`runtime.backends.trt.TrtBackend.make_cache`), and, with a fixed
            window, ``why_window_fixed`` (:func:`runtime.decode.admission.why_no_adaptive_masks` quotes it).
        config: the bundle config.
        engine_config: batch size, scheme and per-slot length.

    Attributes:
        why_no_adaptive_masks: where every step is W wide, why and what to do (a request for adaptive masks is
            refused with it); None where they act (:func:`runtime.decode.admission.why_no_adaptive_masks`).

    Raises:
        SettingError: ``max_batch_size`` exceeds a bounded backend's largest batch (``max_batch``
            not None: a TensorRT optimization profile, or a fused bundle's 1), or ``max_seq_len`` exceeds the model's
            max context or the backend's largest past, or is below the fewest positions that serve a request
            (:func:`runtime.decode.admission.check_max_seq_len`, every backend).
    """

    def __init__(self, backend, config: BundleConfig, engine_config: EngineConfig = EngineConfig()):
        self.backend, self.config, self.engine_config = backend, config, engine_config
        check_max_batch_size(engine_config.max_batch_size, backend.max_batch)
        max_len = check_max_seq_len(engine_config.max_seq_len, config.max_context, backend.max_past, config.window)
        make_cache = getattr(backend, "make_cache", KVCache)  # a GPU backend keeps the cache in device memory
        self.cache = make_cache(config.num_layers, config.num_kv_heads, config.head_dim, max_len,
                                np.dtype(config.dtype), engine_config.max_batch_size)
        self.is_window_dynamic = backend.is_window_dynamic  # T-token prefill, shorter AR steps
        self.prefill_chunk = engine_config.prefill_chunk if self.is_window_dynamic else 0
        self.scheduler = Scheduler(engine_config.max_batch_size, config.window, engine_config.scheme,
                                   self.prefill_chunk, self.is_window_dynamic)
        self.why_no_adaptive_masks = why_no_adaptive_masks(backend, engine_config.scheme)  # None: they act
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

    def room(self, num_prompt: int) -> int:
        """The context budget: tokens a slot can still generate after a prompt of ``num_prompt``
        tokens, S - W - num_prompt (S = ``cache.max_len``: the model's max context, the backend's
        largest past, ``max_seq_len``). Reads only constants, so any thread may call it."""
        return self.cache.max_len - self.config.window - num_prompt

    def add_request(self, prompt_ids: list[int], params: DecodeParams, request_id: str | None = None) -> str:
        """Queue a request; returns its id.

        Raises:
            ParamError: empty prompt or an id outside the vocabulary (field ``prompt``), block_size
                above the bundle's B (``block_size``), max_new_tokens beyond :meth:`room`
                (``max_new_tokens``), or adaptive masks where every step is W wide (``adaptive_masks``,
                :func:`runtime.decode.admission.why_no_adaptive_masks`).
        """
        cfg = self.config
        check_prompt_ids(prompt_ids, cfg.vocab_size)
        if params.adaptive_masks and self.why_no_adaptive_masks:
            raise ParamError("adaptive_masks", self.why_no_adaptive_masks)
        block_size = params.block_size or cfg.block_size
        if block_size > cfg.block_size:
            raise ParamError("block_size", f"block_size {block_size} exceeds the bundle's block size {cfg.block_size}")
        if params.max_new_tokens > self.room(len(prompt_ids)):
            raise ParamError("max_new_tokens",
                             f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) + window "
                             f"({cfg.window}) = {len(prompt_ids) + params.max_new_tokens + cfg.window} exceeds the "
                             f"{self.cache.max_len} positions a slot can hold (the model's max context, the backend's "
                             "largest past, max_seq_len); shorten the prompt or lower max_new_tokens")
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
        """One step: schedule, run the forward, accept per row, commit (DESIGN.md §3-4).

        Raises:
            CannotGrowCache: the KV cache could not grow for some rows; they are finished, this step runs no batch
                forward (any prefill chunk it ran is committed) and the next step goes on with the others.
        """
        plan = self.scheduler.schedule(self.default_tau)
        for group in plan.prefill:
            if len(group) == 1:
                self._prefill_chunk(group[0])
            else:
                self._prefill_first_chunks(group)
        if not plan.rows:
            return []
        outputs, presents, reads = self._run(plan)  # logits [n, w, V], or the argmax ids [n, w]
        accepted = [self._accept(seq, outputs[seq.slot], plan.is_block, reads) for seq in plan.rows]
        return self._commit(plan, accepted, presents)

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
        self._reserve([(seq, int(self.cache.lengths[seq.slot]) + len(chunk))])
        self.cache.commit_slot(seq.slot, run_prefill(self.backend, self.cache, seq.slot, chunk), 0, len(chunk))
        self._count_prefilled(seq, len(chunk))

    def _prefill_first_chunks(self, group: list[Sequence]) -> None:
        """Commit the first prefill chunks of several rows with nothing cached yet in one forward (batched prefill)."""
        chunks = [seq.prefill_chunk(self.prefill_chunk) for seq in group]
        self._reserve([(seq, len(chunk)) for seq, chunk in zip(group, chunks)])
        presents = run_first_chunks(self.backend, self.cache, chunks, self.config.pad_token_id)
        for row, (seq, chunk) in enumerate(zip(group, chunks)):
            self.cache.commit_slot(seq.slot, presents, row, len(chunk))
            self._count_prefilled(seq, len(chunk))

    def _reserve(self, needs: list[tuple[Sequence, int]], idle_need: int = 0) -> None:
        """Make the cache hold the positions each row needs (``needs``: (row, positions) pairs; a free slot of
        the forward: ``idle_need``).

        Raises:
            CannotGrowCache: the larger buffers cannot be allocated; the rows needing more than the cache holds
                are finished first.
        """
        needed = max([idle_need, *(need for _, need in needs)])
        try:
            self.cache.reserve(needed)
        except MemoryError as e:
            capacity = self.cache.capacity
            failed = [seq for seq, need in needs if need > capacity] or [seq for seq, _ in needs]
            for seq in failed:
                self._finish(seq, "abort")
            raise CannotGrowCache([seq.request_id for seq in failed], capacity, needed, self.cache.num_slots,
                                  e) from e

    @staticmethod
    def _count_prefilled(seq: Sequence, num_tokens: int) -> None:
        """Record one prefill forward of ``num_tokens`` prompt tokens, and the prefill time once done."""
        seq.num_prefilled += int(num_tokens)
        seq.result.num_prefill_forwards += 1
        if not seq.is_prefilling:
            seq.result.prefill_seconds = time.perf_counter() - seq.start_time

    def _run(self, plan: StepPlan) -> tuple[np.ndarray, list, str]:
        """One batch forward of the plan's rows (other slots idle). Returns the outputs, the presents and what the
        outputs are (``reads``: ``"ids"`` / ``"proven"``, the argmax ids [n, w], or ``"logits"`` [n, w, V], the mask
        token's logit suppressed; :mod:`runtime.decode.reads` says which)."""
        rows: list[list[int] | None] = [None] * plan.num_rows
        for seq in plan.rows:
            rows[seq.slot] = seq.step_ids(plan.width, self.config.mask_token_id, self.config.pad_token_id)
        # Every row of the forward writes w entries after its length, idle rows (free or sitting out) too.
        self._reserve([(seq, int(self.cache.lengths[seq.slot]) + plan.width) for seq in self.scheduler.running.values()],
                      plan.width)
        head, confidence_tau = choose_head(
            plan.rows, rows, plan.width, [seq.tau(self.default_tau) for seq in plan.rows],
            [self.scheduler.solo_width(seq, self.default_tau) for seq in plan.rows],
            has_greedy_head=getattr(self.backend, "takes_num_greedy", False),
            has_gate=getattr(self.backend, "takes_confidence_gate", False),
            mask_token_id=self.config.mask_token_id, vocab_size=self.config.vocab_size)
        pad = self.config.pad_token_id
        if head == "gate":
            (ids, outputs), presents = run_batch(self.backend, self.cache, rows, pad, greedy_ids=True,
                                                 confidence_tau=confidence_tau)
            reads = "logits" if outputs is not None else "proven"
            outputs = ids if outputs is None else outputs
        else:
            reads = head
            outputs, presents = run_batch(self.backend, self.cache, rows, pad, greedy_ids=head == "ids")
        if reads == "logits":  # the greedy head excludes the mask token itself
            outputs[:, :, self.config.mask_token_id] = np.finfo(np.float32).min  # the mask token is never generated
        self.num_steps += 1
        return outputs, presents, reads

    def _accept(self, seq: Sequence, outputs: np.ndarray, is_block: bool, reads: str) -> Accepted:
        """What this row keeps from its logits [w, V] (or, ``reads`` "ids" / "proven", its argmax ids [w]:
        :meth:`_run`): a W-token prefill commits its chunk; else the acceptance rule over its drafts and the
        predictions from the last real token on."""
        if seq.is_prefilling:
            return Accepted([], len(seq.prefill_chunk(self.config.window)))
        num_real = min(len(seq.uncached), len(outputs))
        # [M, V] (or ids [M]), M = w - r + 1 for the width w this row would have alone: the AR prediction, then one
        # per later input; a wider batch's extra masks are not read (a sampled row draws M numbers: the same alone)
        solo_width = self.scheduler.solo_width(seq, self.default_tau)
        predictions = outputs[num_real - 1:solo_width]
        in_block = is_block and seq.params.mode != "verify"  # verify rows advance per row in both schemes
        budget = max_accept(seq.block_size, seq.num_remaining, len(seq.uncached), self.config.window, in_block)
        if budget == 0:  # block scheme: a full block re-run until every row is ready
            return Accepted([], 0)
        params, tau = seq.params, seq.tau(self.default_tau)
        position = first_read_position(seq, len(outputs), solo_width) if reads == "proven" and tau < 1.0 else None
        if position is not None:  # the gate proved the first confidence read not above tau
            ids, scores = predictions, ProvenRejection(len(predictions), position - (num_real - 1))
        elif reads != "logits":
            ids, scores = predictions, np.zeros(len(predictions), np.float32)  # no confidence is tested
        else:
            ids, scores = select(predictions, params.temperature, params.top_k, params.top_p, params.metric,
                                 seq.rng, with_confidence=tau < 1.0)
        drafts = seq.drafts[:len(predictions) - 1]  # the drafts this step fed
        return accept(ids, scores, tau, drafts, budget, seq.stop_ids, num_real, seq.block_size, in_block)

    def _commit(self, plan: StepPlan, accepted: list[Accepted], presents: list) -> list[StepOutput]:
        """Apply the step: each row's tokens, counters and uncached tokens, the block close, the
        cache commit, then finish the rows that are done. Returns the decoding rows' outputs."""
        counts = np.zeros(plan.num_rows, np.int64)  # [n] KV entries to commit per row
        advanced: list[tuple[Sequence, StepOutput]] = []
        for seq, acc in zip(plan.rows, accepted):
            counts[seq.slot] = acc.num_committed
            if seq.is_prefilling:
                self._count_prefilled(seq, acc.num_committed)
                continue
            if seq.mask_backoff is not None and acc.tokens:
                self._record_masks(seq, acc, plan.width)
            seq.add_tokens(acc.tokens)
            seq.result.num_forwards += 1
            seq.uncached, seq.mask_drafts = (seq.uncached + acc.tokens)[acc.num_committed:], acc.mask_drafts
            reason = seq.finish_reason
            advanced.append((seq, StepOutput(seq.request_id, acc.tokens, reason is not None, reason, seq.result)))
        for seq in plan.block_to_close():
            counts[seq.slot] = self.config.window
            seq.uncached = seq.uncached[self.config.window:]
        self.cache.commit(presents, counts)
        for seq, out in advanced:
            if out.finished:
                self._finish(seq, out.finish_reason)
        return [out for _, out in advanced]

    def _record_masks(self, seq: Sequence, acc: Accepted, width: int) -> None:
        """Adaptive masks: tell the row's backoff whether this step (of width ``width``) read a mask prediction of
        the row (:func:`runtime.decode.reads.read_inputs`) and whether a mask gained a token. Call before
        :meth:`_commit` moves the row's uncached tokens on."""
        num_real, num_drafts, end = read_inputs(seq, width, self.scheduler.solo_width(seq, self.default_tau))
        gained = tokens_from_masks(len(acc.tokens), num_drafts, seq.drafts_from_masks) > 0
        seq.mask_backoff.record(fed_masks=end > num_real + num_drafts, gained=gained)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.result.finish_reason = reason
        seq.result.seconds = time.perf_counter() - seq.start_time if seq.start_time else 0.0
        self.cache.free(seq.slot)
        self.scheduler.finish(seq)
