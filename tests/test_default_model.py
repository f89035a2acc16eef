"""Tier 3: the default model (SmolLM2-135M-Instruct) end to end on real prompts.

The ONNX runtime at tau = 1 must reproduce transformers' greedy ``generate`` id for id
on GSM8K test questions and HumanEval prompts with the chat template applied, alone and
as rows of a batch (both batch schemes), and verify mode must reproduce it too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_export.model_source import default_checkpoint
from runtime.backends.onnx import OnnxBackend
from runtime.bundle import load_config
from runtime.decode.decoder import Decoder
from runtime.decode.engine import Engine, EngineConfig
from runtime.decode.params import DecodeParams
from runtime.text.tokenizer import Tokenizer

from support import real_prompts

MAX_NEW = 128


@pytest.fixture(scope="module")
def hf_model():
    path = default_checkpoint()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def hf_greedy(default_bundle, hf_model, prompts) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers greedy ids) per prompt; checks our chat encoding on the way."""
    model, hf_tokenizer = hf_model
    tokenizer = Tokenizer(default_bundle)
    pairs = []
    for _, text in prompts:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.encode_chat(messages)
        assert ids == list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"])
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(ids):]
        pairs.append((ids, expected.tolist()))
    return pairs


@pytest.fixture(scope="module")
def greedy_pairs(default_bundle, hf_model, shared_data):
    return hf_greedy(default_bundle, hf_model, real_prompts(3))


def check_identity(default_bundle, hf_model, pairs):
    _, hf_tokenizer = hf_model
    config = load_config(default_bundle)
    decoder, tokenizer = Decoder(OnnxBackend(default_bundle, config), config), Tokenizer(default_bundle)
    for ids, expected in pairs:
        result = decoder.generate(ids, DecodeParams(tau=1.0, max_new_tokens=MAX_NEW))
        assert result.token_ids == expected, f"prompt {tokenizer.decode(ids)[:80]!r} diverged"
        assert result.tpf == 1.0
        assert tokenizer.decode(result.token_ids) == hf_tokenizer.decode(expected, skip_special_tokens=True)


def test_export_recorded_parity(default_bundle):
    config = load_config(default_bundle)
    assert config.mask_token == "<empty_output>" and config.mask_token_id == 16
    assert config.parity["top1_agreement"] == 1.0
    assert config.parity["max_abs_logit_diff"] <= config.parity["tolerance"]


def test_tau_one_equals_generate_on_real_prompts(default_bundle, hf_model, greedy_pairs):
    check_identity(default_bundle, hf_model, greedy_pairs)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_data")
def test_tau_one_equals_generate_on_ten_prompts_each(default_bundle, hf_model):
    check_identity(default_bundle, hf_model, hf_greedy(default_bundle, hf_model, real_prompts(10)))


@pytest.mark.parametrize("scheme, mode, draft", [("continuous", "ar", "masks"), ("block", "ar", "masks"),
                                                 ("continuous", "verify", "masks"), ("continuous", "verify", "lookup"),
                                                 ("block", "verify", "both"), ("continuous", "threshold", "lookup"),
                                                 ("block", "threshold", "both")])
def test_batch_rows_and_verify_mode_equal_generate(default_bundle, greedy_pairs, scheme, mode, draft):
    config = load_config(default_bundle)
    engine = Engine(OnnxBackend(default_bundle, config), config, EngineConfig(max_batch_size=4, scheme=scheme))
    results = engine.generate([ids for ids, _ in greedy_pairs],
                              DecodeParams(mode=mode, draft=draft, max_new_tokens=MAX_NEW))
    for result, (ids, expected) in zip(results, greedy_pairs):
        assert result.token_ids == expected, f"{scheme}/{mode}/{draft}: a row diverged from its solo greedy run"
    # a plain model: prompt lookup alone gains tokens on real prompts (a block-scheme batch of
    # threshold rows also counts the re-runs of rows waiting for the block to close)
    if draft != "masks" and (scheme == "continuous" or mode == "verify"):
        tpf = sum(r.num_tokens for r in results) / sum(r.num_forwards for r in results)
        assert tpf > 1.2, f"lookup drafts were hardly ever kept (TPF {tpf:.3f})"


@pytest.mark.usefixtures("shared_data")
def test_lower_tau_never_emits_the_mask_token(default_bundle):
    config = load_config(default_bundle)
    decoder, tokenizer = Decoder(OnnxBackend(default_bundle, config), config), Tokenizer(default_bundle)
    _, text = real_prompts(1)[0]
    ids = tokenizer.encode_chat([{"role": "user", "content": text}])
    result = decoder.generate(ids, DecodeParams(tau=0.5, max_new_tokens=32))
    assert config.mask_token_id not in result.token_ids
    assert result.num_forwards <= result.num_tokens


def test_default_mars_merges_the_shipped_adapter():
    from mars_export.model_source import load_model

    loaded = load_model("default-mars")
    base = AutoModelForCausalLM.from_pretrained(default_checkpoint(), dtype=torch.float32)
    assert loaded.mask_token == "<empty_output>" and loaded.mask_token_id == 16
    assert loaded.model.config.mars_block_size == 4
    assert type(loaded.model) is type(base)  # a plain model: the adapter is merged, not wrapped
    merged, original = loaded.model.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight
    assert merged.shape == original.shape and not torch.equal(merged, original)


@pytest.mark.usefixtures("shared_data")
def test_verify_mode_on_the_mars_default_model_is_lossless_and_gains_tokens(default_mars_bundle):
    config = load_config(default_mars_bundle)
    backend, tokenizer = OnnxBackend(default_mars_bundle, config), Tokenizer(default_mars_bundle)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for _, text in real_prompts(3)]
    params = DecodeParams(max_new_tokens=64)
    greedy = [Decoder(backend, config).generate(ids, params).token_ids for ids in prompts]
    engine = Engine(backend, config, EngineConfig(max_batch_size=3))
    results = engine.generate(prompts, DecodeParams(mode="verify", max_new_tokens=64))
    assert [r.token_ids for r in results] == greedy
    tpf = sum(r.num_tokens for r in results) / sum(r.num_forwards for r in results)
    assert tpf > 1.0, f"verify mode kept no drafts on the MARS model (TPF {tpf:.3f})"
