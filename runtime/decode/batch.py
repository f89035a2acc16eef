"""Step-graph inputs for a batch of rows over the slot cache (the only place that builds model arrays).

Dimension letters: n rows, W window, S cache capacity, V vocabulary, T prefill chunk.

Row i of a step is cache slot i. It feeds W token ids at positions ``lengths[i] ..
lengths[i] + W - 1``, where the step writes their KV into the slot (in place); its queries
see the ``lengths[i]`` committed keys of its slot and, causally, the W new keys. An idle row
(a free slot inside the batch, or a row that sits the forward out) feeds padding the same
way, after its committed entries, which it never overwrites; its outputs are ignored and
nothing of it is committed.

A prefill forward (graphs with a dynamic window axis) runs one slot alone over T prompt
tokens instead of W, with the same mask rule, or the first chunks of several slots with
nothing cached yet (batched prefill).
"""

from __future__ import annotations

import numpy as np

from runtime.decode.kv_cache import KVCache


def window_mask(lengths: np.ndarray, capacity: int, window: int) -> np.ndarray:
    """bool [n, 1, W, S]: row i, query q sees cache indices <= lengths[i] + q (its committed keys, then
    its window's keys 0..q at their positions)."""
    keys = np.arange(capacity)  # [S]
    last = lengths[:, None] + np.arange(window)[None]  # [n, W]: the last index query q may see
    return (keys[None, None, :] <= last[:, :, None])[:, None]  # [n, 1, W, S]


def run_batch(backend, cache: KVCache, rows: list[list[int] | None], pad_id: int, greedy_ids: bool = False,
              confidence_tau: np.ndarray | None = None):
    """One forward over slots 0..n-1.

    Args:
        backend: object with ``step(input_ids, position_ids, attention_mask, past)``.
        cache: the slot cache; its capacity must hold every row's length + W, idle rows' too.
        rows: for each slot, W token ids, or None for an idle row.
        pad_id: id fed in idle rows.
        greedy_ids: return each position's argmax id instead of its logits (the backend's greedy head).
        confidence_tau: float32 [n], with ``greedy_ids``: a threshold step through the backend's confidence gate
            (``takes_confidence_gate``, mars_export.confidence_gate), per row the tau of its probability test.

    Returns:
        logits float32 [n, W, V] (with ``greedy_ids``, a backend with ``takes_num_greedy``: each position's
        argmax token int64 [n, W] instead; with ``confidence_tau`` the pair (ids, logits or None where the gate
        skipped the head)), and per layer the presents (key, value) [n, H, S, D] (the step's
        new entries at their positions; the cache's own buffers where the backend writes in place).
    """
    window = next(len(r) for r in rows if r is not None)
    lengths = cache.lengths[:len(rows)]  # [n]
    ids = np.array([r if r is not None else [pad_id] * window for r in rows], np.int64)  # [n, W]
    positions = lengths[:, None] + np.arange(window, dtype=np.int64)[None]              # [n, W]
    mask = window_mask(lengths, cache.capacity, window)
    if confidence_tau is not None:
        return backend.step(ids, positions, mask, cache.past(len(rows)), greedy_ids=True, confidence_tau=confidence_tau)
    if greedy_ids:
        return backend.step(ids, positions, mask, cache.past(len(rows)), greedy_ids=True)
    return backend.step(ids, positions, mask, cache.past(len(rows)))


def run_prefill(backend, cache: KVCache, slot: int, chunk: list[int]):
    """One forward of T prompt tokens of slot ``slot`` alone, after its committed KV (prefill).

    Needs a step graph whose window axis is dynamic (``backend.is_window_dynamic``); the
    T queries see the slot's committed keys and, causally, each other.

    Args:
        backend: as :func:`run_batch`, its ``step`` also taking ``logits=False`` (no logits are read:
            graphs with the ``num_logits`` input skip the output head).
        cache: the slot cache; its capacity must hold the slot's length + T.
        slot: the cache slot.
        chunk: T >= 1 prompt token ids.

    Returns:
        per layer the presents (key, value) [1, H, S, D]; the logits are not needed.
    """
    lengths = cache.lengths[slot:slot + 1]  # [1]
    ids = np.array([chunk], np.int64)  # [1, T]
    positions = lengths[:, None] + np.arange(len(chunk), dtype=np.int64)[None]  # [1, T]
    mask = window_mask(lengths, cache.capacity, len(chunk))  # [1, 1, T, S]
    _, presents = backend.step(ids, positions, mask, cache.past_of(slot), logits=False)
    return presents


def run_first_chunks(backend, cache: KVCache, chunks: list[list[int]], pad_id: int):
    """One forward of the first prompt chunks of n slots with nothing cached yet (batched prefill).

    Row i feeds ``chunks[i]`` (T_i >= 1 ids) then ``pad_id`` up to T = max T_i, at positions 0..T-1 into a
    zeroed scratch past of T positions (the slots are not rows 0..n-1 of the cache); each query sees its
    row's earlier tokens only (causal), so a row's first T_i entries are those of its chunk fed alone and
    the pads after them are not committed.

    Args:
        backend: as :func:`run_prefill`.
        cache: the slot cache (its KV dtype and head sizes).
        chunks: n lists of prompt token ids.
        pad_id: id fed after a shorter chunk.

    Returns:
        per layer the presents (key, value) [n, H, T, D], row i's entries at 0..T-1; the logits are not needed.
    """
    window = max(len(chunk) for chunk in chunks)
    ids = np.array([chunk + [pad_id] * (window - len(chunk)) for chunk in chunks], np.int64)  # [n, T]
    positions = np.tile(np.arange(window, dtype=np.int64), (len(chunks), 1))  # [n, T]
    mask = window_mask(np.zeros(len(chunks), np.int64), window, window)  # [n, 1, T, T]
    scratch = scratch_past(len(cache.keys), len(chunks), cache.num_kv_heads, window, cache.head_dim, cache.dtype)
    _, presents = backend.step(ids, positions, mask, scratch, logits=False)
    return presents


def scratch_past(num_layers: int, num_rows: int, num_kv_heads: int, length: int, head_dim: int,
                 dtype) -> list[tuple[np.ndarray, np.ndarray]]:
    """Zeroed KV ``([n, H, T, D], [n, H, T, D])`` per layer, T = ``length``: a past for a step's entries to be
    written into when no cache slot holds them (zeros: masked keys must hold finite numbers, as 0 * NaN is NaN)."""
    shape = (num_rows, num_kv_heads, length, head_dim)
    return [(np.zeros(shape, dtype), np.zeros(shape, dtype)) for _ in range(num_layers)]
