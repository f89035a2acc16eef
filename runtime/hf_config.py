"""A Hugging Face ``config.json`` as :mod:`runtime.memory` sizes it: the file read and its fields checked, the KV
shape and the parameters counted from them. Torch-free (the runtime's sizing needs no transformers).

Dimension letters: L layers, H KV heads, D head dim, d hidden size, I MLP width, V vocabulary (the glossary in
:mod:`runtime`).
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.model_types import base_model_type

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# The config.json fields sizing reads, each a positive integer where given (check_fields). The required ones; the
# derived ones, where absent or null what transformers derives (kv_heads_and_head_dim); the defaulted one, where
# absent transformers' default for the model type (runtime.context.max_context_of), null refused as transformers
# would keep it (a model of no context).
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size")
DERIVED_FIELDS = ("num_key_value_heads", "head_dim")
DEFAULTED_FIELDS = ("max_position_embeddings",)


def read_config_json(path: Path) -> dict:
    """The fields of the ``config.json`` at ``path``, checked for sizing (:func:`check_fields`).

    Raises:
        ValueError: naming ``path``: it cannot be read, holds no JSON object, or :func:`check_fields` refuses it.
    """
    try:
        raw = json.loads(path.read_bytes().decode())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:  # a ValueError: before JSONDecodeError's
        raise ValueError(f"{path} is not a Hugging Face config.json (not UTF-8 text); give a bundle directory or a "
                         "model's config.json") from e
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: arrays nested too deeply
        raise ValueError(f"{path} is not a Hugging Face config.json (not valid JSON: {e}); give a bundle directory "
                         "or a model's config.json") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a Hugging Face config.json (it holds no JSON object); give a bundle "
                         "directory or a model's config.json")
    try:
        check_fields(raw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return raw


def check_fields(config: dict) -> None:
    """Raise ValueError where ``config``'s model type is not sized here (:data:`ARCHS`, or a MARS ``a2d-*``
    checkpoint of one: :mod:`runtime.model_types`), a field of :data:`REQUIRED_FIELDS` is absent or null, or a
    field sizing reads is given but no positive integer (null counts as given for :data:`DEFAULTED_FIELDS`)."""
    arch = base_model_type(config.get("model_type"))
    if arch not in ARCHS:
        raise ValueError(f"model_type {arch!r} is not supported for sizing; supported: {ARCHS}")
    for name in REQUIRED_FIELDS + DERIVED_FIELDS + DEFAULTED_FIELDS:
        value = config.get(name)
        if value is None and name in REQUIRED_FIELDS:
            raise ValueError(f"config.json lacks {name!r}, needed to size the model")
        is_given = value is not None if name in DERIVED_FIELDS else name in config
        if is_given and (type(value) is not int or value < 1):
            raise ValueError(f"config.json's {name} must be a positive integer, got {value!r}")


def kv_heads_and_head_dim(config: dict) -> tuple[int, int]:
    """H and D of a checked ``config``: ``num_key_value_heads`` and ``head_dim``, or where absent or null what
    transformers derives (the attention heads; ``hidden_size`` / attention heads)."""
    heads = config["num_attention_heads"]
    return config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads


def count_parameters(config: dict) -> int:
    """Parameters of a Llama / Mistral / Qwen2 / Qwen3 / Phi3 causal LM from its ``config.json`` fields
    (also of the MARS authors' ``a2d-*`` checkpoints of those: :mod:`runtime.model_types`).

    Per layer: q, k, v, o projections (biases: q/k/v always for Qwen2, all four when ``attention_bias``),
    gate/up/down MLP (biases when ``mlp_bias``), two RMSNorms of d, and for Qwen3 a q-norm and k-norm of D
    (Phi3 holds q, k, v as one projection and gate, up as one: the same count). Plus the embedding V · d, the final norm d and
    an lm_head V · d unless ``tie_word_embeddings``.

    Args:
        config: fields :func:`check_fields` accepts (:func:`read_config_json` returns such).
    """
    arch = base_model_type(config["model_type"])  # a published MARS checkpoint: its base's count
    d, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, width = config["num_attention_heads"], config["intermediate_size"]
    kv_heads, head_dim = kv_heads_and_head_dim(config)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = d * q + 2 * d * kv + q * d
    if arch == "qwen2":
        attention += q + 2 * kv
    elif config.get("attention_bias", False):
        attention += q + 2 * kv + d
    mlp = 3 * d * width + (2 * width + d if config.get("mlp_bias", False) else 0)
    norms = 2 * d + (2 * head_dim if arch == "qwen3" else 0)
    head = 0 if config.get("tie_word_embeddings", False) else vocab * d
    return vocab * d + layers * (attention + mlp + norms) + d + head
