"""The longest context a bundle holds (``max_context`` in mars_config.json, DESIGN.md §5).

The step graph attends over the whole cache: full causal attention. A model whose attention
slides over its last ``sliding_window`` tokens (Mistral; Qwen2 and Qwen3 with
``use_sliding_window``; any family whose ``layer_types`` holds a ``"sliding_attention"`` layer)
computes the same thing as long as every key a query may see lies in the window (transformers'
sliding mask lets query q see keys q - window + 1 .. q), so its bundle's context is capped to the
window: beyond it the graph's logits would be wrong.
"""

from __future__ import annotations

from transformers import PretrainedConfig


def sliding_window(config: PretrainedConfig) -> int | None:
    """Tokens a query of a sliding-attention layer sees (itself included), or None when no layer slides.

    ``sliding_window`` counts unless ``use_sliding_window`` is False (Qwen2, Qwen3), or the config's
    family declares ``layer_types`` (transformers derives them from Qwen2's ``max_window_layers``) and
    no layer is ``"sliding_attention"``. Mistral declares no ``layer_types``: all its layers slide.
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None) if hasattr(type(config), "layer_types") else None
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def max_context_of(config: PretrainedConfig) -> tuple[int, str | None]:
    """``(max_context, note)``: the model's ``max_position_embeddings``, or its sliding window where that
    is smaller, with ``note`` the line saying so for the export log (None when not capped)."""
    positions = config.max_position_embeddings
    window = sliding_window(config)
    if window is None or window >= positions:
        return positions, None
    return window, (f"max context {window} tokens, the model's sliding attention window (it has {positions} "
                    "positions): the step graph attends over the whole cache, which is sliding attention only "
                    "within the window")
