"""KV cache for a batch of sequences over preallocated buffers (DESIGN.md §3, §4).

Dimension letters: L layers, N slots (batch rows), H KV heads, S capacity (positions per
slot), D head dim, W window, n rows in one step (the slots 0..n-1).

Layout: per layer one key and one value buffer ``[N, H, S, D]``; slot ``i`` is batch row
``i`` of every step, position p of a slot lies at index p, and ``lengths[i]`` is how many
of its positions hold committed KV. The step reads ``buffer[:n]`` directly (a slice on the
leading axis is a contiguous view) and writes each row's window entries into it at their
positions (:mod:`runtime.backends.kv_binding`); the attention mask hides positions
``>= lengths[i]`` of each row (stale KV of earlier requests and uncommitted entries included).

Presents, what a backend's step returns per layer, have the cache's layout ``[n, H, S', D]``:
row i's new entries at their positions. When they are this cache's own buffers (the
onnxruntime backends) the entries already lie where they are committed and a commit only
counts them; other presents (TensorRT outputs, a batched prefill's scratch past) are copied.

Memory traffic of the cache manager per step:
  - :meth:`past`, :meth:`past_of`: none (views, made once per set of buffers).
  - :meth:`commit`: nothing for in-place presents; else writes ``2 * L * H * D * count_i``
    elements for each row ``i`` (only positions whose input was a real token; KV of mask and
    padding positions stays beyond the length, hidden); :meth:`commit_slot` likewise for a
    T-token prefill chunk.
  - :meth:`reserve`: the capacity S doubles (or halves) only when the longest row needs it,
    copying the committed prefix once; over a generation of C positions this totals less
    than ``2 * C`` positions per row, i.e. O(1) per generated token.
The graph itself reads the whole ``[n, H, S, D]`` past each step, so S is kept within 2x
of the longest row (4x after rows shrink, before :meth:`reserve` shrinks it).

Memory: every slot holds S positions, whoever uses them, so the cache's largest size is
``N * max_len`` positions; while :meth:`reserve` grows it to ``max_len`` the buffers it grows
from are held too (:meth:`KVCache.peak_positions` per slot). Growth that cannot be allocated
raises MemoryError and leaves the cache as it was.
"""

from __future__ import annotations

import numpy as np

MIN_CAPACITY = 16


class KVCache:
    """Per-layer key/value buffers ``[N, H, S, D]`` and the committed length of each slot.

    Args:
        num_layers, num_kv_heads, head_dim: model shape.
        max_len: the most positions one slot may ever hold. The capacity S grows up to it and
            never beyond, and S is the past length every step hands the graph, so the engine
            passes at most the backend's ``max_past`` (a TensorRT optimization profile's).
        dtype: numpy dtype of the bundle's KV (float32 or float16).
        num_slots: N, the most sequences cached at once.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype, num_slots: int = 1):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_len, self.dtype, self.num_slots = max_len, np.dtype(dtype), num_slots
        self.lengths = np.zeros(num_slots, dtype=np.int64)  # [N] committed positions per slot
        self._set_buffers([], [])  # keys, values: L x [N, H, S, D] each
        self._allocate(min(MIN_CAPACITY, max_len))

    @property
    def capacity(self) -> int:
        """S, positions per slot in the current buffers."""
        return self.keys[0].shape[2]

    @staticmethod
    def peak_positions(max_len: int) -> int:
        """Positions per slot held at the cache's largest, by :meth:`reserve`'s growth rule: ``max_len``, plus
        while it grows to ``max_len`` the buffers it grows from (the largest capacity below it,
        ``MIN_CAPACITY * 2**k``; none when ``max_len`` is the first capacity)."""
        previous = MIN_CAPACITY
        while previous * 2 < max_len:
            previous *= 2
        return max_len + (previous if previous < max_len else 0)

    def reserve(self, needed: int) -> None:
        """Make S at least ``needed``: double until it fits (capped at ``max_len``); halve while the
        longest row is under S / 4 (where the smaller buffers cannot be allocated, the current ones stay).

        Raises:
            ValueError: ``needed`` exceeds ``max_len``.
            MemoryError: the larger buffers cannot be allocated (the cache is left as it was).
        """
        if needed > self.max_len:
            raise ValueError(f"KV cache overflow: {needed} positions > capacity {self.max_len}")
        used = max(int(self.lengths.max()), needed)
        target = self.capacity
        while target < needed:
            target *= 2
        while target > MIN_CAPACITY and used * 4 <= target:
            target //= 2
        target = min(target, self.max_len)
        if target > self.capacity:
            self._allocate(target)
        elif target < self.capacity:
            try:
                self._allocate(target)
            except MemoryError:  # shrinking only saves reading and memory: the larger buffers serve as well
                pass

    def past(self, num_rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Views ``([n, H, S, D], [n, H, S, D])`` per layer of slots 0..n-1 (no copy).

        The same view objects until the buffers are reallocated, so a backend that bound them last step
        (:class:`runtime.backends.kv_binding.KVBinding`) knows them by identity, without comparing addresses."""
        return self._views(0, num_rows)

    def past_of(self, slot: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Views ``([1, H, S, D], [1, H, S, D])`` per layer of slot ``slot`` alone (prefill; no copy), kept as
        :meth:`past`'s."""
        return self._views(slot, slot + 1)

    def _views(self, first: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer the views of slots ``first .. end - 1``, made once per set of buffers; a new list each call."""
        views = self._view_memo.get((first, end))
        if views is None:
            views = self._view_memo[first, end] = [(self._rows(k, first, end - first), self._rows(v, first, end - first))
                                                   for k, v in zip(self.keys, self.values)]
        return list(views)

    @staticmethod
    def _rows(buffer: np.ndarray, first: int, count: int) -> np.ndarray:
        """Slots ``first .. first + count - 1`` of a ``[N, H, S, D]`` buffer as ``[count, H, S, D]`` (a view)."""
        return buffer[first:first + count]

    def _set_buffers(self, keys: list, values: list) -> None:
        """Hold new key and value buffers (L x [N, H, S, D]); views of the old ones are made anew. The one way
        the buffers change (subclasses too): assigning ``keys`` / ``values`` directly would leave stale views."""
        self.keys, self.values = keys, values
        self._view_memo: dict[tuple[int, int], list[tuple]] = {}  # (first, end) -> per layer (key, value) views

    def __getstate__(self) -> dict:
        """Pickle and deepcopy without the views: a copy's views would be copies, not views of its buffers."""
        return {**self.__dict__, "_view_memo": {}}

    def commit(self, presents: list[tuple[np.ndarray, np.ndarray]], counts) -> None:
        """Commit, for each row i, the ``counts[i]`` new entries of presents ``[n, H, S', D]`` at positions
        ``lengths[i] ..`` to slot i.

        Raises:
            ValueError: a slot would overflow the current capacity (call :meth:`reserve` first).
        """
        counts = np.asarray(counts, dtype=np.int64)  # [n]
        ends = self.lengths[:len(counts)] + counts
        if (ends > self.capacity).any():
            raise ValueError(f"KV cache overflow: {int(ends.max())} positions > capacity {self.capacity}")
        if not self._is_written(presents):
            for row in np.flatnonzero(counts):
                self._write(row, presents, row, int(counts[row]))
        self.lengths[:len(counts)] = ends

    def commit_slot(self, slot: int, presents: list[tuple[np.ndarray, np.ndarray]], row: int, count: int) -> None:
        """Commit the ``count`` entries of row ``row`` of presents ``[n, H, S', D]`` at positions ``lengths[slot] ..``
        to slot ``slot`` (prefill).

        Raises:
            ValueError: the slot would overflow the current capacity (call :meth:`reserve` first).
        """
        end = int(self.lengths[slot]) + count
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.capacity}")
        if not self._is_written(presents):
            self._write(slot, presents, row, count)
        self.lengths[slot] = end

    def _is_written(self, presents) -> bool:
        """``presents`` are views of these buffers: the step wrote the entries where they are committed."""
        first = presents[0][0]
        return isinstance(first, np.ndarray) and np.may_share_memory(first, self.keys[0])

    def _write(self, slot: int, presents: list[tuple[np.ndarray, np.ndarray]], row: int, count: int) -> None:
        """Copy entries ``lengths[slot] .. + count`` of ``presents`` row ``row`` into slot ``slot``."""
        start = int(self.lengths[slot])
        for (k_new, v_new), k, v in zip(presents, self.keys, self.values):
            k[slot, :, start:start + count] = k_new[row, :, start:start + count]
            v[slot, :, start:start + count] = v_new[row, :, start:start + count]

    def free(self, slot: int) -> None:
        """Forget slot ``slot``'s KV (its buffers are reused as they are; the mask hides them)."""
        self.lengths[slot] = 0

    def _allocate(self, capacity: int) -> None:
        shape = (self.num_slots, self.num_kv_heads, capacity, self.head_dim)
        keep = min(capacity, self.capacity) if self.keys else 0
        # One allocation for all 2L buffers: numpy puts arrays of 4 MiB and more on transparent huge pages, which a
        # batch-1 step's per-layer buffers alone are not (batch 1, P 1024: the step 0.94-0.98x, BENCHMARKS.md).
        block = np.zeros((2, self.num_layers, *shape), self.dtype)
        keys, values = list(block[0]), list(block[1])  # per layer a C-contiguous view [N, H, S, D]
        for old, new in zip(self.keys + self.values, keys + values):
            new[:, :, :keep] = old[:, :, :keep]
        self._set_buffers(keys, values)
