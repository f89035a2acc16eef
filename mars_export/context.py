"""The longest context a bundle holds, of a transformers config: :mod:`runtime.context`'s rule over its fields."""

from __future__ import annotations

from transformers import PretrainedConfig

from runtime import context


def config_fields(config: PretrainedConfig) -> dict:
    """``config``'s fields as its ``config.json`` holds them, less a ``layer_types`` its family does not declare
    (a Mistral config given one keeps it as an attribute, but every Mistral layer slides)."""
    fields = config.to_dict()
    if not hasattr(type(config), "layer_types"):
        fields.pop("layer_types", None)
    return fields


def max_context_of(config: PretrainedConfig) -> tuple[int, str | None]:
    """:func:`runtime.context.max_context_of` of ``config``: ``(max_context, note)``, ``note`` the export log's
    line when the sliding window or a longrope model's original context caps the context (None when not capped)."""
    return context.max_context_of(config_fields(config))
