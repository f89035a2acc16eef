"""Run onnxruntime-genai's model-builder graph (fused attention) as a batch-1 step backend (GitHub issue 11).

PROTOTYPE (branch ``fused``): the builder graph of a bundle's model — ``GroupQueryAttention`` with
rotary, ``SkipSimplifiedLayerNormalization``, one packed QKV MatMul — behind the step interface
of :class:`runtime.backends.onnx.OnnxBackend`, so that the engine drives it unchanged.

- The KV cache lives here, one buffer [1, Hkv, S, D] per layer and name bound as both past and
  present (I/O binding); GroupQueryAttention writes a window's W new entries at P .. P+W-1 in
  place, P = the window's first position (the engine's committed length). Entries the engine does
  not commit (masks, rejected drafts) lie beyond the committed length and are overwritten by the
  next window. The ``past`` the engine passes is ignored; ``presents`` returned are copies of the
  W new entries (the engine's own KVCache still keeps them: twice the KV memory, prototype).
- **No window holds a single token.** GroupQueryAttention's CPU kernel gives a token the same bits
  for every cut of the tokens into windows of >= 2 (``bench/builder_step.py`` identity rows), but
  other bits in a one-token window. A one-token step runs as two (the token and a pad whose output
  and KV are dropped), so tau = 1 stays exactly greedy AR and verify exactly AR.
- Batch 1 only: the kernel refuses a window > 1 over a past at batch > 1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.backends.providers import import_onnxruntime
from runtime.bundle import BundleConfig

ort = import_onnxruntime()

MIN_WINDOW = 2  # GroupQueryAttention: one-token windows get other bits than longer ones


class FusedBackend:
    """A model-builder graph (``model.onnx`` of ``python -m onnxruntime_genai.models.builder``) as a step backend.

    Args:
        model_path: the builder's ``model.onnx`` of the bundle's model (same weights).
        config: the bundle's config (shapes, pad id).
        num_threads: intra-op threads; 0 lets onnxruntime choose.
        max_len: S, the KV buffer length (positions); default the model's context.
    """

    def __init__(self, model_path: str | Path, config: BundleConfig, num_threads: int = 0, max_len: int | None = None):
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self.config = config
        self.max_batch, self.max_past, self.is_window_dynamic = 1, max_len or config.max_context, True
        shape = (1, config.num_kv_heads, self.max_past, config.head_dim)  # [1, Hkv, S, D]
        self.buffers = [np.zeros(shape, np.float32) for _ in range(2 * config.num_layers)]
        self.values = [ort.OrtValue.ortvalue_from_numpy(b) for b in self.buffers]  # the buffers' memory

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray, past):
        """One forward of W tokens at positions P .. P+W-1 over the P positions this backend holds.

        Args:
            input_ids: int64 [1, W]; position_ids: int64 [1, W], consecutive from P;
            attention_mask, past: ignored (causal over the held KV, as the engine's mask says).

        Returns:
            logits float32 [1, W, V], and per layer (key, value) [1, Hkv, W, D] copies of the new entries.

        Raises:
            ValueError: batch > 1, or P + W beyond S.
        """
        batch, window = input_ids.shape
        if batch != 1:
            raise ValueError(f"the fused graph runs batch 1 only, got {batch} rows")
        start = int(position_ids[0, 0])
        ids = input_ids if window >= MIN_WINDOW else np.concatenate(
            [input_ids, np.full((1, MIN_WINDOW - window), self.config.pad_token_id, np.int64)], axis=1)
        width = ids.shape[1]
        if start + width > self.max_past:
            raise ValueError(f"positions {start}..{start + width - 1} do not fit the KV buffer of {self.max_past}")
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, start + width), np.int64))
        binding.bind_output("logits")
        for layer in range(self.config.num_layers):
            for j, kind in enumerate(("key", "value")):
                value = self.values[2 * layer + j]
                binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
                binding.bind_ortvalue_output(f"present.{layer}.{kind}", value)
        self.session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()[:, :window]
        new = [b[:, :, start:start + window].copy() for b in self.buffers]
        return logits, list(zip(new[0::2], new[1::2]))
