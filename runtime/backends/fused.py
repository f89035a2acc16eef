"""The step of a fused bundle: onnxruntime-genai's model-builder graph at batch 1, its KV cache written in place (GitHub issue 11).

A fused bundle (``graph: "fused"`` in mars_config.json, ``mars-export --graph fused``) holds the graph
onnxruntime-genai's model builder writes from the bundle's checkpoint: GroupQueryAttention with
rotary, SkipSimplifiedLayerNormalization, one packed QKV MatMul (:mod:`runtime.bundle` has its I/O).
:class:`runtime.backends.onnx.OnnxBackend` runs it through :class:`FusedStep`, behind the same
``step`` as the step graph, so the engine drives both unchanged:

- **The KV cache is written in place.** The past handed to the step is the engine's slot cache
  itself, per layer and name one buffer [1, Hkv, S, D]; it is bound (I/O binding) as both the past
  input and the present output, and GroupQueryAttention writes a window's W new entries at
  positions P .. P+W-1 of it, P being the window's first position (the committed length). The
  step returns views of those entries. :class:`FusedKVCache`, the cache the engine makes for a
  fused backend, therefore copies nothing at commit: the entries already lie where they are
  committed; entries not committed (masks, rejected drafts, the pad below) lie beyond the
  committed length, hidden, and the next window writes over them. Host copies of the KV per
  step: none (the step graph does the same, :mod:`runtime.backends.kv_binding`).
- **No attention runs a single row.** On onnxruntime's CPU kernel a token gets the same bits for
  every cut of the tokens into windows of two or more, but other bits in a one-token window
  (``bench/builder_step.py``, identity rows; the kernel's one-row GEMV path). Bundles exported
  since the seventh session (2026-12-01) carry a graph that runs a one-token window's attention as two rows
  itself (``mars_export.fused_graph.tile_one_token_windows``, model metadata
  ``mars_edge.one_token_window: tiled``): the step feeds the one token, with an attention mask of
  P + 2 and room for the second row's KV at P + 1. Older fused bundles get a pad token instead
  (the whole model runs two rows; the pad's output and KV are dropped). Either way tau = 1 stays
  exactly greedy AR, and verify mode exactly AR (DESIGN.md §3).
- **Ids instead of logits.** A float32 fused graph exported since the fourteenth session has the
  greedy head (``mars_export.greedy_head``; ``takes_num_greedy``): asked for ``greedy_ids``, the step
  feeds ``num_logits`` 0 and ``num_greedy`` W and returns each row's argmax id, the float32 output head
  skipped; otherwise it feeds ``num_greedy`` 0.
- **Threshold steps through the confidence gate.** Such a graph exported since the twenty-eighth session also
  has the confidence gate (``mars_export.confidence_gate``; ``takes_confidence_gate``, its ``confidence_tau`` a
  required input): given a row's tau, the step returns the ids and the logits, or the ids alone where the gate
  proved the tau test at the first mask fails and skipped the float32 head. Other steps feed tau -1, which never
  skips.
- Batch 1 only: the kernel refuses a window of several tokens over a past at batch > 1.
"""

from __future__ import annotations

import numpy as np

from runtime.backends.kv_binding import KVBinding
from runtime.bundle import (ATTENTION_MASK, CONFIDENCE_TAU, INPUT_IDS, NUM_GREEDY, NUM_LOGITS, BundleConfig,
                            check_confidence_tau, why_no_confidence_gate)
from runtime.decode.kv_cache import KVCache

MIN_WINDOW = 2  # GroupQueryAttention: a one-row attention gets other bits than longer ones
ONE_TOKEN_WINDOW_KEY, TILED = "mars_edge.one_token_window", "tiled"  # as mars_export.fused_graph writes them


class FusedStep:
    """The forward of a fused graph, its KV written into the past in place; the I/O binding kept between steps.

    The past and present of every layer are bound once per set of buffers (:class:`KVBinding`):
    while a step's past is the memory of the last step's, only ``input_ids``, ``attention_mask``
    and ``logits`` are bound again. A graph
    marked ``tiled`` runs a one-token window as one token; others get a pad token after it.

    Args:
        session: an onnxruntime InferenceSession of the fused graph (CPU); ort: the onnxruntime module.
        config: the bundle's config.
    """

    def __init__(self, session, ort, config: BundleConfig):
        self.config = config
        # fused graphs exported since 2026-12-02 take num_logits (required; mars_export.logits_rows)
        inputs = {i.name for i in session.get_inputs()}
        self.takes_num_logits = NUM_LOGITS in inputs
        # float32 fused graphs exported since 2026-12-02 (the fourteenth session) have the greedy head (mars_export.greedy_head)
        self.takes_num_greedy = NUM_GREEDY in inputs
        # ... and since the twenty-eighth session its confidence gate (mars_export.confidence_gate)
        self.takes_confidence_gate = CONFIDENCE_TAU in inputs
        self.kv = KVBinding(session, ort)
        self.is_tiled = session.get_modelmeta().custom_metadata_map.get(ONE_TOKEN_WINDOW_KEY) == TILED

    def __call__(self, input_ids: np.ndarray, position_ids: np.ndarray,
                 past: list[tuple[np.ndarray, np.ndarray]], logits: bool = True,
                 greedy_ids: bool = False, confidence_tau: np.ndarray | None = None) -> tuple:
        """One forward of W tokens at positions P .. P+W-1 (P = ``position_ids[0, 0]``), the new KV written into ``past``.

        Args:
            input_ids: int64 [1, W]; position_ids: int64 [1, W], P .. P+W-1.
            past: per layer (key, value), each a C-contiguous float32 [1, Hkv, S, D] holding the committed
                entries at 0 .. P-1. With S >= P + max(W, 2) (a :class:`FusedKVCache` reserves that) it is
                written in place at P .. P+max(W, 2)-1; a shorter one (a past of exactly P entries) is
                first copied into new buffers of P + max(W, 2) positions, and those are written.
            logits: False when no logits are read (prefill): the output head is skipped where the
                graph takes ``num_logits``.
            greedy_ids: return each row's argmax token instead of its logits, from the greedy head
                (``takes_num_greedy``; the float32 output head is then skipped).
            confidence_tau: float32 [1], with ``greedy_ids``: a threshold step through the confidence gate
                (``takes_confidence_gate``), the tau of the row's probability test.

        Returns:
            logits float32 [1, W, V] ([1, 0, V] when ``logits`` is False), or with ``greedy_ids`` the ids
            int64 [1, W] (the mask token never among them), or with ``confidence_tau`` the pair (ids int64 [1, W],
            logits float32 [1, W, V] or None where the gate skipped the head); and per layer (key, value)
            [1, Hkv, S, D]: the written buffers (``past`` itself, or the copies with room).

        Raises:
            ValueError: more than one row, positions that do not follow on from P, P + max(W, 2)
                beyond the model's context, ``greedy_ids`` on a graph without the greedy head, or
                ``confidence_tau`` without ``greedy_ids`` or on a graph without the gate.
        """
        batch, window = input_ids.shape
        start = int(position_ids[0, 0])
        if batch != 1:
            raise ValueError(f"a fused bundle runs one sequence at a time (batch 1), got {batch} rows; "
                             "set the batch size to 1 or export with --graph step")
        check_confidence_tau(confidence_tau, greedy_ids,
                             None if self.takes_confidence_gate else why_no_confidence_gate(self.config))
        if greedy_ids and not self.takes_num_greedy:
            dtype = self.config.weight_dtype
            fix = (f"read the logits: an --{dtype} bundle's argmaxes come from its own {dtype} output head"
                   if dtype != self.config.dtype else "re-export it with mars-export --graph fused, or read the logits")
            raise ValueError(f"this fused graph has no greedy head (num_greedy input); {fix}")
        if not np.array_equal(position_ids[0], np.arange(start, start + window)):
            raise ValueError(f"a fused graph takes consecutive positions from the committed length, got {position_ids[0]}")
        ids = input_ids
        if window < MIN_WINDOW and not self.is_tiled:
            pad = np.full((1, MIN_WINDOW - window), self.config.pad_token_id, np.int64)
            ids = np.concatenate([input_ids, pad], axis=1)  # [1, MIN_WINDOW]
        end = start + written_positions(window)
        if end > self.config.max_context:
            raise ValueError(f"positions up to {end - 1} exceed the model's context of {self.config.max_context}")
        if past[0][0].shape[2] < end:
            past = past_with_room(past, start, window)
        binding = self.kv.bind_kv(past)
        binding.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(ids, np.int64))
        binding.bind_cpu_input(ATTENTION_MASK, np.ones((1, end), np.int64))
        # the head's rows: a gated step's unless the gate skips it, none where only ids or no logits are read
        rows = (ids.shape[1] if logits and not greedy_ids or confidence_tau is not None or not self.takes_num_logits
                else 0)
        if self.takes_num_logits:
            binding.bind_cpu_input(NUM_LOGITS, np.array(rows, np.int64))
        if not self.takes_num_greedy:
            out = self.kv.run((1, rows, self.config.vocab_size))  # [1, W fed or 0, V]
            return out[:, :window if logits else 0], past
        greedy_rows = ids.shape[1] if greedy_ids else 0
        binding.bind_cpu_input(NUM_GREEDY, np.array(greedy_rows, np.int64))
        if not self.takes_confidence_gate:
            out, chosen = self.kv.run_with_ids((1, rows, self.config.vocab_size), (1, greedy_rows))
        else:  # tau -1 never skips: an ungated step runs as on a graph without the gate
            tau = np.full(1, -1, np.float32) if confidence_tau is None else confidence_tau
            binding.bind_cpu_input(CONFIDENCE_TAU, np.ascontiguousarray(tau, np.float32))
            out, chosen, skipped = self.kv.run_gated((1, rows, self.config.vocab_size), (1, greedy_rows))
            if confidence_tau is not None:
                return (chosen[:, :window], None if skipped else out[:, :window]), past
        return (chosen[:, :window], past) if greedy_ids else (out[:, :window if logits else 0], past)


def written_positions(window: int) -> int:
    """KV positions a fused step of ``window`` tokens writes from P on: max(W, 2) (a one-token window's
    second attention row, or its pad on older graphs, writes at P + 1)."""
    return max(window, MIN_WINDOW)


def past_with_room(past: list[tuple[np.ndarray, np.ndarray]], start: int,
                   window: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Zeroed buffers [1, Hkv, P + :func:`written_positions` (W), D] per layer and name holding the first
    P = ``start`` positions of ``past``: a past a fused step of ``window`` tokens can write into."""
    length = start + written_positions(window)

    def grown(buffer: np.ndarray) -> np.ndarray:
        room = np.zeros((*buffer.shape[:2], length, buffer.shape[3]), buffer.dtype)
        room[:, :, :start] = buffer[:, :, :start]
        return room
    return [tuple(grown(buffer) for buffer in pair) for pair in past]


class FusedKVCache(KVCache):
    """The engine's KV cache for a fused backend: one slot, room for what a fused step writes.

    Same buffers, lengths, growth rule and in-place commit as :class:`~runtime.decode.kv_cache.KVCache`;
    :meth:`reserve` leaves one position more for the second attention row (tiled graph) or the pad
    (older graphs) of a one-token window (:data:`MIN_WINDOW`), so the step always can write in place.

    Args:
        num_layers, num_kv_heads, head_dim, max_len, dtype: as ``KVCache``.
        num_slots: must be 1.

    Raises:
        ValueError: ``num_slots`` is not 1.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype, num_slots: int = 1):
        if num_slots != 1:
            raise ValueError(f"a fused bundle runs one sequence at a time (1 KV slot), got {num_slots}; "
                             "set the batch size to 1 or export with --graph step")
        super().__init__(num_layers, num_kv_heads, head_dim, max_len, dtype, num_slots)

    def reserve(self, needed: int) -> None:
        """As ``KVCache.reserve``, with room for a one-token window's second row when the context allows it."""
        super().reserve(needed if needed > self.max_len else min(needed + MIN_WINDOW - 1, self.max_len))
