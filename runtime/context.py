"""The longest context a model's bundle holds (``max_context`` in mars_config.json, DESIGN.md §5), from the
fields of its ``config.json``.

Torch-free, so that both the exporter (:mod:`mars_export.context`, for the bundle's ``max_context``) and the
runtime's sizing (:mod:`runtime.memory`, which reads a ``config.json``) apply the one rule.

The step graph attends over the whole cache: full causal attention. A model whose attention slides over
its last ``sliding_window`` tokens (Mistral; Qwen2 and Qwen3 with ``use_sliding_window``; any family whose
``layer_types`` holds a ``"sliding_attention"`` layer) computes the same thing as long as every key a query
may see lies in the window (transformers' sliding mask lets query q see keys q - window + 1 .. q), so its
bundle's context is capped to the window: beyond it the graph's logits would be wrong.
"""

from __future__ import annotations

from collections.abc import Mapping


def sliding_window(fields: Mapping) -> int | None:
    """Tokens a query of a sliding-attention layer sees (itself included), or None when no layer slides.

    Args:
        fields: the model's ``config.json`` fields (or a transformers config's ``to_dict()``).

    ``sliding_window`` counts unless ``use_sliding_window`` is False (Qwen2, Qwen3), or ``layer_types`` is
    given and holds no ``"sliding_attention"``. Without ``layer_types``, ``max_window_layers`` gives them as
    transformers derives them for Qwen2 and Qwen3 (layers from that index on slide); without either, every
    layer slides (Mistral).
    """
    window = fields.get("sliding_window")
    if not window or fields.get("use_sliding_window", True) is False:
        return None
    layer_types = fields.get("layer_types")
    if layer_types is None and fields.get("max_window_layers") is not None:
        num_layers, first_sliding = fields.get("num_hidden_layers", 0), fields["max_window_layers"]
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def max_context_of(fields: Mapping) -> tuple[int, str | None]:
    """``(max_context, note)``: the model's ``max_position_embeddings``, or its sliding window where that is
    smaller, with ``note`` the line saying so (None when not capped).

    Args:
        fields: as for :func:`sliding_window`; ``max_position_embeddings`` is read (0 when absent).
    """
    positions = fields.get("max_position_embeddings") or 0
    window = sliding_window(fields)
    if window is None or window >= positions:
        return positions, None
    return window, (f"max context {window} tokens, the model's sliding attention window (it has {positions} "
                    "positions): the step graph attends over the whole cache, which is sliding attention only "
                    "within the window")
