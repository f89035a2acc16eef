"""The longest context a model's bundle holds (``max_context`` in mars_config.json, DESIGN.md §5), from the
fields of its ``config.json``.

Torch-free, so that both the exporter (:mod:`mars_export.context`, for the bundle's ``max_context``) and the
runtime's sizing (:mod:`runtime.memory`, which reads a ``config.json``) apply the one rule.

The step graph attends over the whole cache: full causal attention. A model whose attention slides over
its last ``sliding_window`` tokens (Mistral; Qwen2 and Qwen3 with ``use_sliding_window``; any family whose
``layer_types`` holds a ``"sliding_attention"`` layer) computes the same thing as long as every key a query
may see lies in the window (transformers' sliding mask lets query q see keys q - window + 1 .. q), so its
bundle's context is capped to the window: beyond it the graph's logits would be wrong.

A model with longrope rope scaling (Phi-3 128k, Phi-3.5) rotates every position with its short factors while a
forward's positions stay within ``original_max_position_embeddings``, and every position with its long factors
once one passes it (transformers picks the set by the forward's largest position). Keys already in the cache were
rotated with the short factors, so step-wise decoding cannot follow that switch: the bundle's context is capped to
``original_max_position_embeddings``, within which the step graph (and the fused graph, which picks its cache by
the attention mask's length) uses the short factors throughout, as transformers does. Where transformers reads
that field, and which rope type names mean longrope, is :func:`longrope_original_context`'s to say; where
transformers reads the rope settings (``rope_scaling`` or ``rope_parameters``, possibly one per layer type, as
Gemma3's ``full_attention`` and ``sliding_attention``), and which rope type it runs, is :func:`rope_settings`'.

Dynamic-NTK rope scaling needs no cap: transformers rescales that rope only once a forward passes
``max_position_embeddings``, which no bundle's context does (the step graph traces it as the default rope,
:func:`mars_export.step_module.step_graph_model`, and the fused graph's builder is given it as the default rope,
:func:`mars_export.fused_graph.prepare_builder_config`). Linear, yarn and llama3 frequencies do not depend on the
sequence: nothing to cap (which of them the fused graph computes as transformers does is
:data:`mars_export.fused_graph.FUSED_ROPE_TYPES`' to say).
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime.model_types import base_model_type

# What a config.json that lacks one of the fields the rule reads means, per model type: transformers' defaults
# (models/<type>/configuration_<type>.py, transformers 5.x). Qwen2 and Qwen3 slide only with use_sliding_window,
# from layer max_window_layers on; Gemma2 slides every other layer, Gemma3 five of six (sliding_window_pattern);
# Mistral slides every layer. A type not listed has no default: a missing field is absent.
FIELD_DEFAULTS: dict[str, dict] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096},
    "phi3": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096},
    "qwen2": {"max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "num_hidden_layers": 32},
    "qwen3": {"max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "num_hidden_layers": 32},
    "gemma2": {"max_position_embeddings": 8192, "sliding_window": 4096, "sliding_window_pattern": 2,
               "num_hidden_layers": 26},
    "gemma3_text": {"max_position_embeddings": 131072, "sliding_window": 4096, "sliding_window_pattern": 6,
                    "num_hidden_layers": 26},
}


# Fields a config.json may hold that transformers does not read for the model type, so neither do we: Mistral and
# Phi3 slide every layer whatever layer_types say (their configs do not declare them; Mistral's warns); Gemma2
# slides every other layer whatever sliding_window_pattern says (Gemma3 reads it).
UNREAD_FIELDS: dict[str, tuple[str, ...]] = {
    "mistral": ("layer_types",),
    "phi3": ("layer_types",),
    "gemma2": ("sliding_window_pattern",),
}


def with_defaults(fields: Mapping) -> dict:
    """``fields`` as transformers reads them: less those it ignores (:data:`UNREAD_FIELDS`), with its default of
    each field they lack (:data:`FIELD_DEFAULTS`); both by the model type or, for a MARS authors' ``a2d-*`` type,
    its base's (:mod:`runtime.model_types`)."""
    model_type = base_model_type(fields.get("model_type"))
    unread = UNREAD_FIELDS.get(model_type, ())
    return {**FIELD_DEFAULTS.get(model_type, {}), **{k: v for k, v in fields.items() if k not in unread}}


def sliding_window(fields: Mapping) -> int | None:
    """Tokens a query of a sliding-attention layer sees (itself included), or None when no layer slides.

    Args:
        fields: the model's ``config.json`` fields (or a transformers config's ``to_dict()``); a field it lacks
            takes transformers' default for its ``model_type`` (:func:`with_defaults`).

    ``sliding_window`` counts unless ``use_sliding_window`` is False (Qwen2, Qwen3), or ``layer_types`` is
    given and holds no ``"sliding_attention"``. Without ``layer_types``, they are derived as transformers does:
    from ``max_window_layers`` (Qwen2, Qwen3: layers from that index on slide), from ``sliding_window_pattern``
    (Gemma2, Gemma3: every layer but each pattern-th slides); with neither, every layer slides (Mistral).
    """
    fields = with_defaults(fields)
    window = fields.get("sliding_window")
    if not window or fields.get("use_sliding_window", True) is False:
        return None
    layer_types = fields.get("layer_types")
    if layer_types is None:
        layer_types = _derived_layer_types(fields)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _derived_layer_types(fields: Mapping) -> list[str] | None:
    """transformers' ``layer_types`` of a config without them, or None where every layer slides."""
    num_layers = fields.get("num_hidden_layers", 0)
    if fields.get("max_window_layers") is not None:
        first_sliding = fields["max_window_layers"]
        return ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    if fields.get("sliding_window_pattern") is not None:
        pattern = fields["sliding_window_pattern"]
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return None


# The rope type names transformers runs as longrope: "su" is longrope's first name (Phi-3's); Phi3Config also
# renames "yarn" to longrope, which the other types run as yarn.
LONGROPE_NAMES = ("longrope", "su")
LONGROPE_NAMES_OF_TYPE = {"phi3": ("longrope", "su", "yarn")}
# Model types whose config declares a top-level original_max_position_embeddings (Phi3Config, default 4096:
# FIELD_DEFAULTS), which transformers writes into the rope settings over theirs; other types read the rope settings'.
TOP_LEVEL_ORIGINAL_TYPES = ("phi3",)
# Model types whose config holds the rope settings per layer type, a default for each of full_attention and
# sliding_attention, and puts a rope_scaling (older files) into full_attention's (Gemma3TextConfig).
PER_LAYER_ROPE_TYPES = ("gemma3_text",)
ALL_LAYERS = ""  # the layer type key of rope settings that apply to every layer


def rope_settings(fields: Mapping) -> dict[str, dict]:
    """The rope settings transformers reads from ``fields``, by the layer type they apply to (:data:`ALL_LAYERS`
    where they are not given per layer type), each as written with ``rope_type`` set where it is missing (to
    ``type``, else ``"default"``), as transformers' ``standardize_rope_params`` sets it.

    Args:
        fields: as for :func:`sliding_window`. The settings are ``rope_scaling`` (older files) where it is set, else
            ``rope_parameters`` (transformers 5); a dict of dicts (``{"full_attention": {...}, "sliding_attention":
            {...}}``) holds settings per layer type (a layer type saved as None has none). For the types of
            :data:`PER_LAYER_ROPE_TYPES` a rope_scaling goes into full_attention's settings instead.
    """
    fields = with_defaults(fields)
    scaling, parameters = fields.get("rope_scaling"), fields.get("rope_parameters")
    if base_model_type(fields.get("model_type")) in PER_LAYER_ROPE_TYPES:
        rope = {"full_attention": {}, "sliding_attention": {}, **(parameters or {})}
        if scaling:
            rope["full_attention"] = {**(rope["full_attention"] or {}), **scaling}
    else:
        rope = scaling or parameters or {}
    per_layer = rope if any(isinstance(value, Mapping) for value in rope.values()) else {ALL_LAYERS: rope}
    return {layer: {"rope_type": settings.get("type", "default"), **settings}
            for layer, settings in per_layer.items() if settings is not None}


def rope_types(fields: Mapping) -> dict[str, str]:
    """The rope type transformers runs, by layer type (the keys of :func:`rope_settings`): their ``rope_type``, a
    name of longrope (:data:`LONGROPE_NAMES_OF_TYPE`, else :data:`LONGROPE_NAMES`) as ``"longrope"``."""
    longrope_names = LONGROPE_NAMES_OF_TYPE.get(base_model_type(fields.get("model_type")), LONGROPE_NAMES)
    return {layer: "longrope" if settings["rope_type"] in longrope_names else settings["rope_type"]
            for layer, settings in rope_settings(fields).items()}


def longrope_original_context(fields: Mapping) -> int | None:
    """The positions a model with longrope rope scaling keeps its short factors for (the
    ``original_max_position_embeddings`` transformers' rope reads; with settings per layer type, the fewest of
    those with longrope), or None without longrope scaling.

    Args:
        fields: as for :func:`sliding_window`; the rope settings and types as transformers reads them
            (:func:`rope_settings`, :func:`rope_types`).

    The top-level field (for Phi3, 4096 when absent) comes before the rope settings' for the types that declare it
    (:data:`TOP_LEVEL_ORIGINAL_TYPES`), except under the name ``"su"``: transformers moves the top-level field
    into the rope settings only for a type it knows (longrope, yarn, llama3), before Phi3Config renames ``"su"``,
    so an ``"su"`` model keeps the rope settings' own. Settings without the field have nothing to cap
    (transformers takes ``max_position_embeddings``).
    """
    fields = with_defaults(fields)
    top_level = base_model_type(fields.get("model_type")) in TOP_LEVEL_ORIGINAL_TYPES
    settings, types = rope_settings(fields), rope_types(fields)
    originals = []
    for layer in (layer for layer, rope_type in types.items() if rope_type == "longrope"):
        rope = settings[layer]
        original = rope.get("original_max_position_embeddings")
        named_su = "su" in (rope["rope_type"], rope.get("type"))  # a loaded config's to_dict() keeps "type" as written
        if top_level and not (original and named_su):
            original = fields.get("original_max_position_embeddings") or original
        if original:
            originals.append(int(original))
    return min(originals, default=None)


def max_context_of(fields: Mapping) -> tuple[int, str | None]:
    """``(max_context, note)``: the model's ``max_position_embeddings``, or its sliding window or its longrope
    ``original_max_position_embeddings`` where smaller, with ``note`` the line saying so (None when not capped).

    Args:
        fields: as for :func:`sliding_window`; ``max_position_embeddings`` is read (transformers' default for the
            model type when absent, :data:`FIELD_DEFAULTS`; 0 for a type without one).
    """
    positions = with_defaults(fields).get("max_position_embeddings") or 0
    window, original = sliding_window(fields), longrope_original_context(fields)
    caps = []
    if window is not None and window < positions:
        caps.append((window, f"max context {window} tokens, the model's sliding attention window (it has {positions} "
                             "positions): the step graph attends over the whole cache, which is sliding attention "
                             "only within the window"))
    if original is not None and original < positions:
        caps.append((original, f"max context {original} tokens, the model's original_max_position_embeddings (it has "
                               f"{positions} positions): longrope rope scaling switches every position to its long "
                               "factors once a sequence passes them, which keys cached with the short ones cannot "
                               "follow"))
    return min(caps, default=(positions, None))
