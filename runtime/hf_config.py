"""A Hugging Face ``config.json`` as :mod:`runtime.memory` sizes it: the file read, the parameters counted from its
fields. Torch-free (the runtime's sizing needs no transformers).

Dimension letters: L layers, H KV heads, D head dim, d hidden size, I MLP width, V vocabulary (the glossary in
:mod:`runtime`).
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.model_types import base_model_type

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# config.json fields count_parameters reads: positive integers; the optional ones may be absent or null (derived)
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size")
OPTIONAL_FIELDS = ("num_key_value_heads", "head_dim")


def read_config_json(path: Path) -> dict:
    """The JSON object in ``path``; ValueError naming the path where it cannot be read or holds none."""
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
    return raw


def count_parameters(config: dict) -> int:
    """Parameters of a Llama / Mistral / Qwen2 / Qwen3 / Phi3 causal LM from its ``config.json`` fields
    (also of the MARS authors' ``a2d-*`` checkpoints of those: :mod:`runtime.model_types`).

    Per layer: q, k, v, o projections (biases: q/k/v always for Qwen2, all four when ``attention_bias``),
    gate/up/down MLP (biases when ``mlp_bias``), two RMSNorms of d, and for Qwen3 a q-norm and k-norm of D
    (Phi3 holds q, k, v as one projection and gate, up as one: the same count). Plus the embedding V · d, the final norm d and
    an lm_head V · d unless ``tie_word_embeddings``.

    Raises:
        ValueError: another ``model_type``, a required field is missing, or a field of :data:`REQUIRED_FIELDS` or
            :data:`OPTIONAL_FIELDS` is not a positive integer.
    """
    arch = base_model_type(config.get("model_type"))  # a published MARS checkpoint: its base's count
    if arch not in ARCHS:
        raise ValueError(f"model_type {arch!r} is not supported for sizing; supported: {ARCHS}")
    for name in REQUIRED_FIELDS + OPTIONAL_FIELDS:
        value = config.get(name)
        if value is None and name in REQUIRED_FIELDS:
            raise ValueError(f"config.json lacks {name!r}, needed to count parameters")
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"config.json's {name} must be a positive integer, got {value!r}")
    d, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, width = config["num_attention_heads"], config["intermediate_size"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or d // heads
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
