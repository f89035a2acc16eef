"""The longest context a bundle holds, of a transformers config: :mod:`runtime.context`'s rule over its fields."""

from __future__ import annotations

from transformers import PretrainedConfig

from runtime import context


def config_fields(config: PretrainedConfig) -> dict:
    """``config``'s fields as its ``config.json`` holds them (a field its family does not read, such as a Mistral
    config's ``layer_types``, is left to :func:`runtime.context.with_defaults`)."""
    return config.to_dict()


def max_context_of(config: PretrainedConfig) -> tuple[int, str | None]:
    """:func:`runtime.context.max_context_of` of ``config``: ``(max_context, note)``, ``note`` the export log's
    line when the sliding window or a longrope model's original context caps the context (None when not capped)."""
    return context.max_context_of(config_fields(config))
