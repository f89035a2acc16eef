"""Who runs next and how wide: the waiting queue, KV slots, and each step's plan (no arrays).

Slots are handed out lowest first, so the running rows stay packed at the start of the
cache and a step's batch is the slots ``0 .. n - 1`` (a free slot inside that range, or a
row that sits the forward out, runs as an idle row whose output is ignored).

The plan of one step covers both batch schemes (DESIGN.md §4):
  - admission: ``continuous`` admits whenever a slot is free; ``block`` only at a block
    boundary (every running row holds just its anchor token uncached);
  - prefill: with a dynamic window axis (``prefill_chunk`` > 0) a prefilling row first runs
    one chunk of up to T prompt tokens in a forward of its own, and sits the batch forward
    out unless that chunk finishes its prompt; otherwise it feeds W prompt tokens in the
    batch forward. Rows with nothing cached yet whose first chunks are of near length share
    that forward (batched prefill: padding at most :data:`MAX_PREFILL_PADDING` of its rows);
  - width: W, or (continuous scheme, dynamic window, no W-token prefill row) the widest
    row's need, capped at W;
  - block boundaries: which rows fed a full block of W real tokens (the block closes once
    every live threshold row did, :meth:`StepPlan.block_to_close`).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass

from runtime.decode.sequence import Sequence

SCHEMES = ("continuous", "block")
# Batched prefill pads a group's shorter chunks to its longest: at most this fraction of the forward's rows are
# padding. One forward of n first chunks was 1.06-1.22x faster than n forwards (default model, 2 cores,
# BENCHMARKS.md "Batched prefill"), so more padding than that would cost what batching saves.
MAX_PREFILL_PADDING = 0.1


def can_narrow_steps(scheme: str, is_window_dynamic: bool) -> bool:
    """Whether a step may be narrower than W (only as wide as its widest row needs): the continuous scheme on a
    graph whose window axis is dynamic. The block scheme re-runs W-wide blocks, and a fixed window axis takes W
    tokens, so there every step is W wide. Adaptive masks act only where this holds
    (:func:`runtime.decode.admission.why_no_adaptive_masks`)."""
    return scheme == "continuous" and is_window_dynamic


@dataclass(frozen=True)
class StepPlan:
    """One step's plan.

    Attributes:
        prefill: groups of rows that first run one prefill chunk (dynamic window), each group one
            forward: a group of several holds rows with nothing cached yet (batched prefill).
        rows: rows of the batch forward, ordered by slot (prefilling rows feed W prompt tokens).
        num_rows: n, the batch rows of the forward (idle rows included).
        width: w, the ids each row feeds.
        is_block: the block scheme.
        full_rows: slots of the threshold rows that feed W real tokens (block scheme): their
            block is full once this step accepts.
    """

    prefill: list[list[Sequence]]
    rows: list[Sequence]
    num_rows: int
    width: int
    is_block: bool
    full_rows: frozenset[int]

    def block_to_close(self) -> list[Sequence]:
        """Block scheme, after acceptance: the live threshold rows, if every one of them fed a
        full block (then each commits its W block entries); else none."""
        live = [s for s in self.rows if s.params.mode != "verify" and not s.is_prefilling
                and s.finish_reason is None]
        return live if self.is_block and live and all(s.slot in self.full_rows for s in live) else []


class Scheduler:
    """FIFO admission of waiting sequences into free KV slots, and the plan of each step.

    Args:
        num_slots: N, the most sequences running at once.
        window: W, the step graph's window.
        scheme: one of :data:`SCHEMES` (checked by :class:`runtime.decode.engine.EngineConfig`).
        prefill_chunk: T, prompt tokens per prefill forward; 0 prefills through the W-token step.
        is_window_dynamic: the step graph takes windows shorter than W.
    """

    def __init__(self, num_slots: int, window: int, scheme: str = "continuous", prefill_chunk: int = 0,
                 is_window_dynamic: bool = False):
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free = list(range(num_slots))     # heap of free slots
        self.window, self.scheme, self.prefill_chunk = window, scheme, prefill_chunk
        self.can_shrink = can_narrow_steps(scheme, is_window_dynamic)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, default_tau: float) -> StepPlan:
        """Admit what may join now, prepare verify drafts, and plan the step.

        Args:
            default_tau: the engine's live default tau (rows without their own tau use it).
        """
        self._admit()
        running = [self.running[slot] for slot in sorted(self.running)]
        prefill = [s for s in running if self.prefill_chunk and s.is_prefilling]
        joining = {s.slot for s in prefill if self._prefill_finishes(s)}  # decode in this step's forward too
        rows = [s for s in running if not (self.prefill_chunk and s.is_prefilling) or s.slot in joining]
        for seq in rows:
            if seq.params.uses_drafts and (seq.slot in joining or not seq.is_prefilling):
                seq.prepare_drafts()
        is_block = self.scheme == "block"
        full = frozenset(s.slot for s in rows if is_block and s.params.mode != "verify" and not s.is_prefilling
                         and len(s.uncached) >= self.window)
        return StepPlan(self._prefill_groups(prefill), rows, self.num_rows, self._width(rows, default_tau), is_block,
                        full)

    def finish(self, seq: Sequence) -> None:
        """Take a running sequence out and free its slot."""
        del self.running[seq.slot]
        heapq.heappush(self._free, seq.slot)
        seq.slot = None

    def find(self, request_id: str) -> Sequence | None:
        """The waiting or running sequence with this id, if any."""
        return next((s for s in [*self.waiting, *self.running.values()] if s.request_id == request_id), None)

    def remove_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)

    @property
    def num_rows(self) -> int:
        """Batch rows of the next step: the highest running slot + 1."""
        return max(self.running) + 1 if self.running else 0

    def _admit(self) -> None:
        """Move waiting sequences into free slots (block scheme: only at a block boundary)."""
        can_admit = self.scheme == "continuous" or all(len(s.uncached) == 1 for s in self.running.values())
        while can_admit and self.waiting and self._free:
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self._free)
            seq.start_time = time.perf_counter()
            self.running[seq.slot] = seq

    def _prefill_groups(self, prefill: list[Sequence]) -> list[list[Sequence]]:
        """One forward per group: rows with nothing cached yet, longest first chunk first, share one as long as
        padding the chunks to the longest keeps within :data:`MAX_PREFILL_PADDING` of the rows; others alone."""
        def length(seq: Sequence) -> int:
            return len(seq.prefill_chunk(self.prefill_chunk))

        groups: list[list[Sequence]] = []
        for seq in sorted((s for s in prefill if s.num_prefilled == 0), key=length, reverse=True):
            lengths = [length(s) for s in (groups[-1] if groups else [])] + [length(seq)]
            rows = len(lengths) * lengths[0]
            if len(lengths) > 1 and rows - sum(lengths) <= MAX_PREFILL_PADDING * rows:
                groups[-1].append(seq)
            else:
                groups.append([seq])
        return groups + [[s] for s in prefill if s.num_prefilled > 0]

    def _prefill_finishes(self, seq: Sequence) -> bool:
        """Whether this step's prefill chunk caches the rest of the prompt (the row then decodes now)."""
        return len(seq.prompt_ids) - 1 - seq.num_prefilled <= self.prefill_chunk

    def solo_width(self, seq: Sequence, default_tau: float) -> int:
        """The width ``seq``'s step would have if it ran alone (a decoding row). The engine reads no prediction of
        a row beyond it, so that a row's tokens, mask drafts and (sampling) random draws do not depend on the
        rows beside it: a wider neighbour only adds mask inputs this row would not have fed."""
        return self._width([seq], default_tau)

    def _width(self, rows: list[Sequence], default_tau: float) -> int:
        """w: W, or (continuous scheme, dynamic window) the widest :meth:`_row_width`, capped at W."""
        if not rows or not self.can_shrink or any(s.is_prefilling and not self.prefill_chunk for s in rows):
            return self.window
        return min(max(self._row_width(s, default_tau) for s in rows), self.window)

    @staticmethod
    def _row_width(seq: Sequence, default_tau: float) -> int:
        """Inputs a row can use: its uncached real tokens, then one draft or mask per further
        token it may accept when its setting feeds masks (:meth:`DecodeParams.uses_masks`) and,
        with adaptive masks, its backoff lets it (:mod:`runtime.decode.mask_backoff`), else only
        its drafts (none: one token, as AR)."""
        uses_masks = seq.params.uses_masks(seq.tau(default_tau)) and (
            seq.mask_backoff is None or seq.mask_backoff.feeds_masks)
        return len(seq.uncached) + (seq.block_size - 1 if uses_masks else len(seq.drafts))
