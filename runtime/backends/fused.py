"""The KV cache and the step of a fused bundle: onnxruntime-genai's model-builder graph at batch 1 (GitHub issue 11).

A fused bundle (``graph: "fused"`` in mars_config.json, ``mars-export --graph fused``) holds the graph
onnxruntime-genai's model builder writes from the bundle's checkpoint: GroupQueryAttention with
rotary, SkipSimplifiedLayerNormalization, one packed QKV MatMul (:mod:`runtime.bundle` has its I/O).
:class:`runtime.backends.onnx.OnnxBackend` runs it through :class:`FusedStep`, behind the same
``step`` as the step graph, so the engine drives both unchanged:

- The KV cache lives here: one buffer [1, Hkv, S, D] per layer and name, bound as both past and
  present (I/O binding). GroupQueryAttention writes a window's W new entries at P .. P+W-1 in
  place, P being the window's first position (the engine's committed length); entries the engine
  does not commit (masks, rejected drafts) lie beyond its committed length and the next window
  writes over them. S doubles when a window would not fit (the content is copied once).
- **No window holds a single token.** On onnxruntime's CPU kernel a token gets the same bits for
  every cut of the tokens into windows of two or more, but other bits in a one-token window
  (``bench/builder_step.py``, identity rows). A one-token step therefore runs as two tokens (the
  token and a pad, whose output is dropped and whose KV lies beyond the committed length), and
  tau = 1 stays exactly greedy AR, verify mode exactly AR (DESIGN.md §3).
- Batch 1 only: the kernel refuses a window of several tokens over a past at batch > 1.
"""

from __future__ import annotations

import numpy as np

from runtime.bundle import ATTENTION_MASK, INPUT_IDS, LOGITS, BundleConfig, past_names, present_names

MIN_WINDOW = 2  # GroupQueryAttention: a one-token window gets other bits than longer ones
INITIAL_LENGTH = 256  # S of the first buffers, in positions; doubled as needed up to the model's context


class FusedStep:
    """The held KV cache of a fused graph and one forward over it.

    Args:
        session: an onnxruntime InferenceSession of the fused graph (CPU).
        ort: the onnxruntime module (its OrtValue).
        config: the bundle's config.
    """

    def __init__(self, session, ort, config: BundleConfig):
        self.session, self.ort, self.config = session, ort, config
        self.length = 0
        self.buffers: list[np.ndarray] = []
        self.values: list = []
        self._grow(INITIAL_LENGTH)

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray) -> tuple[np.ndarray, list]:
        """One forward of W tokens at positions P .. P+W-1 (P = ``position_ids[0, 0]``) over the held KV.

        Args:
            input_ids: int64 [1, W]; position_ids: int64 [1, W], P .. P+W-1.

        Returns:
            logits float32 [1, W, V], and per layer (key, value) [1, Hkv, W, D]: copies of the W new entries.

        Raises:
            ValueError: more than one row, positions that do not follow on from P, or P + W beyond
                the model's context.
        """
        batch, window = input_ids.shape
        start = int(position_ids[0, 0])
        if batch != 1:
            raise ValueError(f"a fused bundle runs one sequence at a time (batch 1), got {batch} rows; "
                             "set the batch size to 1 or export with --graph step")
        if not np.array_equal(position_ids[0], np.arange(start, start + window)):
            raise ValueError(f"a fused graph takes consecutive positions from the committed length, got {position_ids[0]}")
        ids = input_ids
        if window < MIN_WINDOW:
            pad = np.full((1, MIN_WINDOW - window), self.config.pad_token_id, np.int64)
            ids = np.concatenate([input_ids, pad], axis=1)  # [1, MIN_WINDOW]
        end = start + ids.shape[1]
        if end > self.config.max_context:
            raise ValueError(f"positions up to {end - 1} exceed the model's context of {self.config.max_context}")
        if end > self.length:
            self._grow(max(end, 2 * self.length))
        binding = self.session.io_binding()
        binding.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(ids, np.int64))
        binding.bind_cpu_input(ATTENTION_MASK, np.ones((1, end), np.int64))
        binding.bind_output(LOGITS)
        for layer in range(self.config.num_layers):
            for past, present, value in zip(past_names(layer), present_names(layer), self.values[2 * layer:]):
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
        self.session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()[:, :window]  # [1, W, V]
        new = [buffer[:, :, start:start + window].copy() for buffer in self.buffers]  # [1, Hkv, W, D] each
        return logits, list(zip(new[0::2], new[1::2]))

    def _grow(self, length: int) -> None:
        """Buffers of ``length`` positions (capped at the model's context), the held entries copied in."""
        length = min(length, self.config.max_context)
        shape = (1, self.config.num_kv_heads, length, self.config.head_dim)  # [1, Hkv, S, D]
        buffers = [np.zeros(shape, np.float32) for _ in range(2 * self.config.num_layers)]
        for old, new in zip(self.buffers, buffers):
            new[:, :, :self.length] = old
        self.buffers, self.length = buffers, length
        self.values = [self.ort.OrtValue.ortvalue_from_numpy(buffer) for buffer in buffers]  # their memory, no copy
