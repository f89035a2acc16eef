"""Phi3 with longrope rope scaling (Phi-3 128k): the bundle's context is capped to its
``original_max_position_embeddings`` (runtime.context), as a sliding window caps it.

transformers rotates every position with the short factors while a forward's largest position stays below
``original_max_position_embeddings``, and every position with the long ones once it passes (modeling_rope_utils'
``longrope_frequency_update``); keys cached with the short factors cannot follow that switch, so past it neither
graph can match. Within the cap both graphs pass parity, and the runtime's greedy ids are transformers'. A model
whose rope settings are given per layer type (Gemma3: full_attention, sliding_attention) is capped by its longrope
layers' original context.
"""

from __future__ import annotations

import json

import pytest
import torch
from support import export
from tiny_models import make_checkpoint
from transformers import Gemma3TextConfig, Phi3Config

from mars_export.context import config_fields
from mars_export.model_source import load_checkpoint
from mars_export.parity import chat_prompt_ids
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.context import longrope_original_context, max_context_of
from runtime.decode.decoder import Decoder
from runtime.decode.params import DecodeParams

ORIGINAL = 64  # original_max_position_embeddings of the tiny model, which has 512 positions
NUM_FACTORS = 8  # one per rotary frequency: head dim 16 / 2
# Short and long factors far apart and away from 1, so that a graph using the wrong set (or none) fails parity.
LONGROPE = {"original_max_position_embeddings": ORIGINAL,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                "short_factor": [1.0 + 0.25 * i for i in range(NUM_FACTORS)],
                                "long_factor": [4.0 + 2.0 * i for i in range(NUM_FACTORS)]}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("phi3", tmp_path_factory.mktemp("phi3-longrope") / "ckpt", **LONGROPE)


@pytest.mark.parametrize("fields, expected", [
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "longrope"}}, 4096),  # a Phi-3 128k config.json
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "su"}}, 4096),  # its first name
    ({"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "longrope",
                                                           "original_max_position_embeddings": 4096}}, 4096),
    ({"max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "longrope"}}, 4096),  # Phi-3 4k: nothing to cap
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_scaling": None}, 131072),
], ids=["longrope", "su", "rope-parameters", "no-cap", "no-scaling"])
def test_longrope_caps_the_context_of_config_json_fields(fields, expected):
    assert max_context_of({"model_type": "phi3", **fields})[0] == expected


FACTORS = {"short_factor": [1.0] * NUM_FACTORS, "long_factor": [2.0] * NUM_FACTORS}


@pytest.mark.parametrize("fields", [
    {"original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope", **FACTORS}},
    {"rope_scaling": {"type": "longrope", **FACTORS}},  # Phi3Config's default 4096
    {"rope_parameters": {"rope_type": "longrope", "original_max_position_embeddings": 2048, **FACTORS}},
    {"original_max_position_embeddings": 1024,
     "rope_parameters": {"rope_type": "longrope", "original_max_position_embeddings": 2048, **FACTORS}},
    {"original_max_position_embeddings": 2048, "rope_scaling": {"rope_type": "longrope", **FACTORS},
     "rope_parameters": {"rope_type": "default"}},  # rope_scaling first
    {"original_max_position_embeddings": 2048, "rope_scaling": {"rope_type": "default"},
     "rope_parameters": {"rope_type": "longrope", **FACTORS}},
    {"original_max_position_embeddings": 2048, "rope_scaling": None,
     "rope_parameters": {"rope_type": "longrope", **FACTORS}},
    {"original_max_position_embeddings": 8192,
     "rope_scaling": {"type": "su", "original_max_position_embeddings": 2048, **FACTORS}},
    {"original_max_position_embeddings": 8192, "rope_scaling": {"type": "yarn", **FACTORS}},
    {"original_max_position_embeddings": 2048},
], ids=["phi3-128k", "default", "rope-parameters", "top-level-first", "rope-scaling-first", "rope-scaling-default",
        "rope-scaling-none", "su", "yarn", "no-scaling"])
def test_the_original_context_of_a_config_json_is_transformers(fields):
    """The positions transformers' Phi3 rope keeps its short factors for (its rope settings'
    original_max_position_embeddings, read by Phi3Config from the config.json's fields), of the raw fields and of
    the config loaded from them."""
    fields = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 131072,
              **fields}
    config = Phi3Config.from_dict(json.loads(json.dumps(fields)))  # from_dict: as from_pretrained reads the file
    rope = config.rope_parameters
    expected = rope["original_max_position_embeddings"] if rope["rope_type"] == "longrope" else None
    assert longrope_original_context(fields) == expected
    assert longrope_original_context(config_fields(config)) == expected


PER_LAYER = {"full_attention": {"rope_type": "longrope", "original_max_position_embeddings": 2048, **FACTORS},
             "sliding_attention": {"rope_type": "default"}}


@pytest.mark.parametrize("fields", [
    {"rope_parameters": PER_LAYER},
    {"rope_parameters": {**PER_LAYER, "sliding_attention": None}},
    {"rope_parameters": {**PER_LAYER, "full_attention": {"rope_type": "longrope", **FACTORS}}},
    {"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 2048, **FACTORS}},
    {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    {},
], ids=["per-layer", "sliding-none", "per-layer-no-original", "rope-scaling-to-full-attention", "linear", "none"])
def test_the_original_context_of_rope_settings_per_layer_type_is_transformers(fields):
    """Gemma3 gives rope settings per layer type; a rope_scaling (older files) is full_attention's. The context is
    capped to the original context of the layers transformers runs with longrope (none: its positions)."""
    fields = {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
              "num_hidden_layers": 6, "max_position_embeddings": 131072, "sliding_window": 131072, **fields}
    config = Gemma3TextConfig.from_dict(json.loads(json.dumps(fields)))
    longrope = [rope for rope in config.rope_parameters.values() if rope and rope["rope_type"] == "longrope"]
    expected = min([rope["original_max_position_embeddings"] for rope in longrope], default=131072)
    assert max_context_of(fields)[0] == expected
    assert max_context_of(config_fields(config))[0] == expected


def test_a_gemma3_step_graph_with_longrope_full_attention_is_capped_and_passes_parity(tmp_path, capsys):
    """Longrope on Gemma3's full_attention layers only: uncapped, the parity prompts pass the original context and
    transformers switches those layers to the long factors (max |Δlogit| 2.1 before the per-layer settings were
    read); capped, the step graph passes, and the runtime's sizing of the saved config.json holds the same context."""
    rope = {"full_attention": {**LONGROPE["rope_parameters"], "original_max_position_embeddings": ORIGINAL},
            "sliding_attention": {"rope_type": "default"}}
    ckpt = make_checkpoint("gemma3_text", tmp_path / "ckpt", rope_parameters=rope, sliding_window=512,
                           layer_types=["sliding_attention", "full_attention"])
    bundle = export(str(ckpt), tmp_path / "step", 4, 4, "--mask-token", "<mask>")
    config = load_config(bundle)
    assert config.max_context == ORIGINAL and config.parity["max_abs_logit_diff"] <= 1e-3
    assert f"max context {ORIGINAL} tokens" in capsys.readouterr().err
    assert max_context_of(json.loads((ckpt / "config.json").read_text()))[0] == ORIGINAL


@pytest.mark.parametrize("graph", ["step", "fused"])
def test_both_graphs_pass_parity_within_the_original_context(checkpoint, graph, tmp_path, capsys):
    bundle = export(str(checkpoint), tmp_path / graph, 4, 4, "--mask-token", "<mask>", "--graph", graph)
    assert f"max context {ORIGINAL} tokens, the model's original_max_position_embeddings" in capsys.readouterr().err
    config = load_config(bundle)
    assert config.max_context == ORIGINAL and config.parity["max_abs_logit_diff"] <= 1e-3


def test_tau_one_equals_transformers_generate(checkpoint, tmp_path):
    bundle = export(str(checkpoint), tmp_path / "step", 4, 4, "--mask-token", "<mask>")
    config = load_config(bundle)
    model, tokenizer = load_checkpoint(checkpoint)
    ids = chat_prompt_ids(tokenizer, "hi there")  # 27 byte tokens: with 30 new and W = 4, 61 positions
    result = Decoder(OnnxBackend(bundle, config), config).generate(ids, DecodeParams(tau=1.0, max_new_tokens=30))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False,
                             pad_token_id=model.config.pad_token_id, suppress_tokens=[config.mask_token_id])
    assert result.token_ids == out[0, len(ids):].tolist()
    assert max_context_of(json.loads((checkpoint / "config.json").read_text()))[0] == ORIGINAL  # the file as saved
