"""Model types of the MARS authors' published checkpoints and the transformers model type of their weights.

Torch-free, so that both the exporter (:mod:`mars_export.model_source`, which loads such a
checkpoint) and the runtime's sizing (:mod:`runtime.hf_config`, which reads its ``config.json``)
read the one table.

The model types of the MARS authors' code (github.com/Xalp/MARS, dllm/pipelines/a2d/models,
from the dllm library, which also has a2d-llama) -> the transformers model type of the same
weights. Their classes subclass transformers' and change only the attention mask used when
none is passed (bidirectional); MARS decoding passes a causal one (the authors' sampler, and
our step graph's explicit mask), which is what the transformers classes do by default.
"""

from __future__ import annotations

A2D_BASE_MODEL_TYPES = {"a2d-qwen2": "qwen2", "a2d-qwen3": "qwen3", "a2d-qwen3-it": "qwen3", "a2d-llama": "llama"}


def base_model_type(model_type: str | None) -> str | None:
    """The transformers model type of ``model_type``: its base for a known ``a2d-*`` type, else itself."""
    return A2D_BASE_MODEL_TYPES.get(model_type, model_type)
