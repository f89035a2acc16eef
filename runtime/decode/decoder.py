"""MARS decoding of one sequence, torch-free (MARS, arXiv 2604.07023, §3; DESIGN.md §3).

:class:`Decoder` runs one prompt through :class:`runtime.decode.engine.Engine` with a single slot;
batches, verify mode and sampling are the engine's.

Dimension letters: W window, V vocabulary, P committed (cached) positions.

One decode step feeds the r committed tokens whose KV is not cached yet, followed by
W - r mask tokens, at consecutive positions P .. P+W-1 under a causal mask. The output at
the last real token is the greedy AR prediction; the output at the j-th mask predicts
the token j places later. So a step offers W - r + 1 predictions and accepts between 1
and min(B, W - r + 1) of them (:func:`runtime.decode.acceptance.count_accepted`). Only the KV of
the r real tokens is committed.

Prefill puts every prompt token but the last into the cache (up to 256 tokens per
forward when the graph's window axis is dynamic, else W at a time through the same step
graph); the last prompt token is the first step's pending token. So every
generated token comes from a decode step and TPF = tokens / decode forwards is exactly
1.0 at tau >= 1.

The mask token is never generated: its logit is set to the float32 minimum before the
argmax. (For a model whose argmax is never the mask token, tau >= 1 is exactly greedy AR.)
"""

from __future__ import annotations

import time

from runtime.bundle import BundleConfig
from runtime.decode.admission import check_max_seq_len, min_seq_len
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.params import DecodeParams, GenerationResult


class Decoder:
    """Prefill + MARS acceptance loop for one sequence over a backend with :meth:`step` (onnxruntime or TensorRT).

    Args:
        backend: object with ``step(input_ids, position_ids, attention_mask, past)`` and
            ``is_window_dynamic`` as in :class:`runtime.backends.onnx.OnnxBackend` (see
            :class:`runtime.decode.engine.Engine`).
        config: the bundle config.
    """

    def __init__(self, backend, config: BundleConfig):
        self.backend = backend
        self.config = config

    def room(self, num_prompt: int) -> int:
        """Tokens a request can generate after a prompt of ``num_prompt`` tokens: the positions one slot can hold
        (the model's max context, the backend's largest past) less the window W and the prompt; :meth:`generate`
        refuses a ``max_new_tokens`` above it."""
        limit = check_max_seq_len(None, self.config.max_context, self.backend.max_past, self.config.window)
        return limit - self.config.window - num_prompt

    def generate(self, prompt_ids: list[int], params: DecodeParams) -> GenerationResult:
        """Generate up to ``params.max_new_tokens`` tokens after ``prompt_ids``.

        Prefill puts every prompt token but the last into the cache (in forwards of up to 256
        tokens when the graph's window axis is dynamic, else W at a time); the last
        prompt token is the first decode step's real token, so TPF is exactly 1.0 at tau >= 1.
        ``result.seconds`` covers the whole call.

        Raises:
            ValueError: empty prompt, block_size above the bundle's B, or prompt plus
                max_new_tokens beyond the bundle's max context.
        """
        start = time.perf_counter()
        # The slot holds what this request can reach (as the C sample's cache), so the capacity S, the past every
        # step reads, doubles up to that and never past it (the model's max context would allow up to twice it).
        limit = check_max_seq_len(None, self.config.max_context, self.backend.max_past, self.config.window)
        # at least the fewest positions a slot takes, so that an empty prompt is refused as one (add_request)
        needed = max(len(prompt_ids) + params.max_new_tokens + self.config.window, min_seq_len(self.config.window))
        engine = Engine(self.backend, self.config, EngineConfig(max_batch_size=1, max_seq_len=min(needed, limit)))
        result = engine.generate([prompt_ids], params)[0]
        result.seconds = time.perf_counter() - start
        return result
