"""Who runs next: waiting requests, KV slots, and the running batch (plain bookkeeping, no arrays).

Slots are handed out lowest first, so the running rows stay packed at the start of the
cache and a step's batch is the slots ``0 .. num_rows - 1`` (a free slot inside that range
runs as an idle row whose output is ignored).
"""

from __future__ import annotations

import heapq
from collections import deque

from runtime.decode.sequence import Sequence


class Scheduler:
    """FIFO admission of waiting sequences into free KV slots (continuous batching).

    Args:
        num_slots: most sequences running at once (the cache's N).
    """

    def __init__(self, num_slots: int):
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free = list(range(num_slots))     # heap of free slots

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, can_admit: bool = True) -> list[Sequence]:
        """Admit waiting sequences into free slots (if ``can_admit``); return the running ones ordered by slot."""
        while can_admit and self.waiting and self._free:
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self._free)
            self.running[seq.slot] = seq
        return [self.running[slot] for slot in sorted(self.running)]

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
